"""The engine-core process: ``python -m asyncstep.engine.transport.core_process --fd N``.

Started by the front end (:class:`~asyncstep.engine.transport.core_client.CoreProcess`)
with one end of a socket pair as file descriptor ``N`` (inherited; no
address, nothing listens, so no handshake), and one more per attached front
end (``--attach-fd M``, repeated: the API servers of ``asyncstep serve
--api-server-count``; :mod:`asyncstep.engine.transport.front_ends`). It receives
:class:`~asyncstep.engine.messages.core_messages.CoreSetup` (the config) and loads
the model (or starts the rank processes) while the front end loads its
tokenizer, receives :class:`CoreStart` (the EOS ids), reports
:class:`CoreReady`, then runs the
:class:`~asyncstep.engine.core.engine_core.EngineCore` in its own ``trio.run`` until the
front end says Shutdown or goes away. An error goes back as
:class:`CoreFailed` before the process exits 1.

It never outlives its parent: its stdin is a pipe from the parent, and when
that closes (the parent died, however) it exits after ``--exit-grace``
seconds; the socket closing starts an orderly stop first. Ctrl-C
belongs to the front end, which shuts the core down: SIGINT is ignored here.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import traceback
from collections.abc import Sequence
from typing import TypeVar

import anyio
import anyio.abc
import trio

from asyncstep.channels.framing import MessageStream
from asyncstep.config import EngineConfig
from asyncstep.engine.core.engine_core import EngineCore
from asyncstep.engine.executor.executor import open_executor
from asyncstep.engine.messages.core_messages import (
    CoreFailed,
    CoreSetup,
    CoreStart,
    FromCore,
    LoadProgress,
    ToCore,
)
from asyncstep.engine.transport.front_ends import PEER_GONE, FrontEnds
from asyncstep.errors import describe, error_kind, root_cause
from asyncstep.kv_cache_interface import kv_cache_groups
from asyncstep.logging import configure_logging, get_logger
from asyncstep.logging.spans import CORE_STARTUP, process_start_us, record_startup, span
from asyncstep.models.model_info import describe_model
from asyncstep.procs import exit_now, exit_when_parent_dies

log = get_logger("engine")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m asyncstep.engine.transport.core_process",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--fd", type=int, required=True, help="the socket to the front end")
    parser.add_argument(
        "--attach-fd",
        type=int,
        action="append",
        default=[],
        help="the socket to one more front end (repeatable)",
    )
    parser.add_argument(
        "--exit-grace",
        type=float,
        default=5.0,
        help="seconds between the parent's death (stdin closed) and this process's exit",
    )
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--log-json", metavar="FILE")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    exit_when_parent_dies(args.exit_grace)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(args.log_level, args.log_json)
    record_startup("imports", process_start_us(), task=CORE_STARTUP)
    return trio.run(serve_core, args.fd, args.attach_fd)


async def serve_core(fd: int, attach_fds: Sequence[int] = ()) -> int:
    """Serve the front end on socket ``fd`` (and those attached on
    ``attach_fds``); returns the exit status."""
    channels = [
        MessageStream[ToCore](await anyio.abc.SocketStream.from_socket(f), ToCore)
        for f in (fd, *attach_fds)
    ]
    channel = channels[0]
    try:
        with span("setup_wait", CORE_STARTUP):
            setup = await _expect(channel, CoreSetup)
        await _run(FrontEnds(channels), setup.config, channel)
    except Exception as exc:
        error = root_cause(exc)
        if isinstance(error, PEER_GONE):
            return 0  # the front end went away: nobody to report to
        log.debug("engine core failed", error=repr(error), traceback=traceback.format_exc())
        failed = CoreFailed(describe(error), error_kind(error))
        with anyio.move_on_after(2, shield=True):
            for each in channels:  # every front end is told why
                with contextlib.suppress(Exception):
                    await each.send(failed)
        return 1
    finally:
        with anyio.CancelScope(shield=True):
            for each in channels:
                await each.aclose()
    return 0


M = TypeVar("M", CoreSetup, CoreStart)


async def _expect(channel: MessageStream[ToCore], kind: type[M]) -> M:
    message = await channel.receive()
    if not isinstance(message, kind):
        raise RuntimeError(f"expected {kind.__name__}, got {type(message).__name__}")
    return message


async def _run(front_ends: FrontEnds, config: EngineConfig, primary: MessageStream[ToCore]) -> None:
    """Load ``config``'s model, then (given :class:`CoreStart` by the
    ``primary`` front end) serve the front ends until Shutdown."""
    events_tx, events_rx = anyio.create_memory_object_stream[FromCore](math.inf)
    inputs_tx, inputs_rx = anyio.create_memory_object_stream[ToCore](math.inf)
    token = trio.lowlevel.current_trio_token()

    def progress(done: int, total: int) -> None:  # called on the loading thread
        if done == total or done % max(total // 50, 1) == 0:
            token.run_sync_soon(events_tx.send_nowait, LoadProgress(done, total))

    async with anyio.create_task_group() as outer:
        outer.start_soon(front_ends.write, events_rx)
        async with open_executor(config, progress=progress, with_tokenizer=False) as opened:
            start = await _expect(primary, CoreStart)
            core = EngineCore(
                config,
                opened.executor,
                frozenset(start.eos_token_ids),
                vocab_size=opened.arch_config.vocab_size,
                load_tokenizer=lambda: describe_model(config.model).tokenizer,
                freeze_heap=True,
                kv_cache_groups=kv_cache_groups(opened.arch_config.layer_windows),
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(front_ends.read, inputs_tx)
                await core.run(inputs_rx, events_tx)
                tg.cancel_scope.cancel()


if __name__ == "__main__":
    exit_now(main())
