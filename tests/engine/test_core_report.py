"""The engine names why its core stopped: the core's own report (its
CoreFailed, say "rank 1 died") over the core's death that follows it, also
when the transport reports the death before the front end has read the
report (the race a loaded machine showed in
``tests/channels/test_parallel.py::test_a_killed_rank_brings_everything_down``).
In-process, with a stand-in core: no timing, no sleeps."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import trio.testing
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.engine.front_end.output_processor import OutputProcessor
from asyncstep.engine.front_end.serving import EngineServing
from asyncstep.engine.messages.core_messages import (
    CoreFailed,
    CoreReady,
    CoreStats,
    FromCore,
    ToCore,
)
from asyncstep.engine.transport.core_client import EngineCoreDied
from asyncstep.errors import EngineDeadError

REPORT = "rank 1 died (killed by signal SIGKILL)"


class DyingCore:
    """Ready, then (the front end waiting for news) its report queued and,
    before the front end can read it, its transport's death raised."""

    def __init__(self, *, frame: bool, report: bool = True) -> None:
        self.frame, self.report = frame, report

    async def run(
        self,
        to_core: MemoryObjectReceiveStream[ToCore],
        from_core: MemoryObjectSendStream[FromCore | bytes],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        await from_core.send(CoreReady(CoreStats()))
        task_status.started()
        await trio.testing.wait_all_tasks_blocked()
        if self.report:
            failed = CoreFailed(REPORT)
            from_core.send_nowait(msgspec.msgpack.encode(failed) if self.frame else failed)
        raise EngineCoreDied("the engine core process exited with status 1")


@pytest.mark.parametrize("frame", [False, True], ids=["message", "frame"])
@pytest.mark.trio
async def test_the_core_s_report_names_the_error_over_its_death(frame: bool) -> None:
    serving = EngineServing(DyingCore(frame=frame), OutputProcessor(lambda message: None))
    await serving.serve()
    assert isinstance(serving.error, EngineDeadError)
    assert str(serving.error) == REPORT


@pytest.mark.trio
async def test_without_a_report_the_death_is_the_error() -> None:
    serving = EngineServing(DyingCore(frame=True, report=False), OutputProcessor(lambda m: None))
    await serving.serve()
    assert isinstance(serving.error, EngineCoreDied)
    assert "exited with status 1" in str(serving.error)
