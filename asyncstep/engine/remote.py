"""Ranks in other processes, driven over the control plane.

:class:`RemoteRanks` has the same contract as the in-process
:class:`~asyncstep.nursery.RankActor`: scheduler outputs in, the driver
rank's model runner outputs out. It listens for the ranks' connections
(loopback unless told otherwise), starts them itself on this machine
(``launch_ranks``) or waits for ranks started elsewhere (torchrun), hands them
the setup, and then broadcasts every step to all of them.

Failure: the first rank error (a :class:`RankFailed` message, a closed
connection, or a process that exits) ends :meth:`RemoteRanks.run` with a
:class:`RankError` naming the rank; on the way out every process it started
is terminated, then killed, so none is left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field

import anyio
import msgspec
from anyio.abc import Process, TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.channels.control import (
    Hello,
    InitKVCache,
    MessageStream,
    RankFailed,
    RankReady,
    RankSetup,
    Shutdown,
    Step,
    StepOutput,
)
from asyncstep.config import EngineConfig
from asyncstep.datatypes import ModelRunnerOutput, SchedulerOutput
from asyncstep.errors import RankError
from asyncstep.logging import get_logger
from asyncstep.logging.spans import span

log = get_logger("engine")


@dataclass
class RemoteRanks:
    """The ranks of ``config``'s layout; where the engine listens, whether it
    starts the ranks and how they log come from ``config.parallel``. Every
    rank receives the whole ``config`` (``model.max_model_len`` resolved)."""

    config: EngineConfig
    #: Seconds to wait for every rank to connect, and then to load its shard.
    connect_timeout_s: float = 120.0
    ready_timeout_s: float = 1800.0
    #: Seconds ranks get to exit after Shutdown before they are terminated.
    exit_timeout_s: float = 10.0
    #: RankReady of every rank, once they are ready.
    ready: list[RankReady] = field(default_factory=list)
    _processes: dict[int, Process] = field(default_factory=dict)
    _streams: dict[int, MessageStream] = field(default_factory=dict)
    _stopping: bool = False

    @property
    def launch(self) -> bool:
        """Start the ranks as local processes; False: wait for ranks started elsewhere."""
        return self.config.parallel.launch_ranks

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size

    @property
    def driver_rank(self) -> int:
        """The first TP rank of the last pipeline stage: it reports the outputs."""
        parallel = self.config.parallel
        return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes.values()]

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[SchedulerOutput],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start (or await) the ranks, report the KV block count, serve steps
        until ``inbox`` closes, then shut the ranks down."""
        listen_host, listen_port = self.config.parallel.listen_address
        listener = await anyio.create_tcp_listener(local_host=listen_host, local_port=listen_port)
        try:
            async with anyio.create_task_group() as tg:
                port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
                if self.launch:
                    await self._spawn(port, tg)
                else:
                    log.warning(
                        "waiting for ranks",
                        world_size=self.world_size,
                        address=f"{listen_host}:{port}",
                        command=f"python -m asyncstep.rank --engine HOST:{port}",
                    )
                with anyio.fail_after(self.connect_timeout_s):
                    await self._accept_all(listener)
                num_blocks = await self._set_up()
                for rank, stream in self._streams.items():
                    tg.start_soon(self._read_rank, rank, stream, outbox)
                task_status.started(num_blocks)
                await self._broadcast(inbox)
                await self._shut_down()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
                if not self._stopping:  # cancelled: tell the ranks still connected
                    self._stopping = True
                    await self._tell_all(Shutdown(), timeout_s=0.5)
                for stream in self._streams.values():
                    await stream.aclose()
                await self._kill_all()

    # -- start ------------------------------------------------------------

    async def _spawn(self, port: int, tg: TaskGroup) -> None:
        master_port = _free_port()
        parallel = self.config.parallel
        for rank in range(self.world_size):
            command = [
                sys.executable,
                "-m",
                "asyncstep.rank",
                "--engine",
                f"127.0.0.1:{port}",
                "--rank",
                str(rank),
                "--world-size",
                str(self.world_size),
                "--local-rank",
                str(rank),
                "--log-level",
                parallel.rank_log_level,
            ]
            if parallel.rank_log_json is not None:
                command += ["--log-json", f"{parallel.rank_log_json}.rank{rank}"]
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
            process = await anyio.open_process(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None, env=env
            )
            self._processes[rank] = process
            tg.start_soon(self._watch, rank, process)
        log.info("ranks started", world_size=self.world_size, pids=self.pids)

    async def _accept_all(self, listener: anyio.abc.Listener[anyio.abc.SocketStream]) -> None:
        accept = listener.listeners[0].accept  # type: ignore[attr-defined]
        while len(self._streams) < self.world_size:
            stream = MessageStream(await accept())
            hello = await stream.receive()
            if not isinstance(hello, Hello):
                raise RankError(f"a rank opened with {type(hello).__name__}, not Hello")
            if hello.world_size != self.world_size or not 0 <= hello.rank < self.world_size:
                parallel = self.config.parallel
                raise RankError(
                    f"rank {hello.rank} of world {hello.world_size} connected; this engine "
                    f"runs {self.world_size} ranks (tp {parallel.tensor_parallel_size} x "
                    f"pp {parallel.pipeline_parallel_size})"
                )
            if hello.rank in self._streams:
                raise RankError(f"rank {hello.rank} connected twice")
            self._streams[hello.rank] = stream

    async def _set_up(self) -> int:
        init_method = None
        if self.launch:  # the ranks' own env carries MASTER_ADDR/PORT
            init_method = "env://"
        # One encoding of the whole config for every rank.
        setup = msgspec.msgpack.encode(RankSetup(self.config, init_method))
        for stream in self._streams.values():
            await stream.send_encoded(setup)
        with anyio.fail_after(self.ready_timeout_s):
            for rank, stream in sorted(self._streams.items()):
                message = await self._receive(rank, stream)
                if not isinstance(message, RankReady):
                    raise RankError(f"rank {rank} sent {type(message).__name__} before RankReady")
                self.ready.append(message)
        num_blocks = min(r.num_blocks for r in self.ready)
        for stream in self._streams.values():
            await stream.send(InitKVCache(num_blocks))
        log.info(
            "ranks ready",
            num_blocks=num_blocks,
            weight_bytes=[r.weight_bytes for r in self.ready],
            devices=[r.device for r in self.ready],
        )
        return num_blocks

    # -- steps ------------------------------------------------------------

    async def _broadcast(self, inbox: MemoryObjectReceiveStream[SchedulerOutput]) -> None:
        encoder = msgspec.msgpack.Encoder()
        async with inbox:
            async for scheduler_output in inbox:
                # The span (encode + a send to each rank) pairs with each
                # rank's ``step_in`` marker: the engine-to-rank hop.
                with span("broadcast", "engine", step=scheduler_output.step_id):
                    frame = encoder.encode(Step(scheduler_output))
                    for rank, stream in self._streams.items():
                        try:
                            await stream.send_encoded(frame)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            raise RankError(await self._death_notice(rank)) from None

    async def _read_rank(
        self, rank: int, stream: MessageStream, outbox: MemoryObjectSendStream[ModelRunnerOutput]
    ) -> None:
        while True:
            message = await self._receive(rank, stream)
            if isinstance(message, StepOutput) and rank == self.driver_rank:
                await outbox.send(message.output)
            else:
                raise RankError(f"rank {rank} sent an unexpected {type(message).__name__}")

    async def _receive(self, rank: int, stream: MessageStream) -> object:
        try:
            message = await stream.receive()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
            if self._stopping:
                await anyio.sleep_forever()
            raise RankError(await self._death_notice(rank)) from None
        if isinstance(message, RankFailed):
            raise RankError(f"rank {message.rank} failed: {message.error}")
        return message

    async def _watch(self, rank: int, process: Process) -> None:
        code = await process.wait()
        if not self._stopping:
            raise RankError(f"rank {rank} {_exit_reason(code)}")

    async def _death_notice(self, rank: int) -> str:
        process = self._processes.get(rank)
        if process is not None:
            with anyio.move_on_after(2):
                return f"rank {rank} {_exit_reason(await process.wait())}"
        return f"rank {rank} closed its connection"

    # -- stop -------------------------------------------------------------

    async def _shut_down(self) -> None:
        self._stopping = True
        await self._tell_all(Shutdown(), timeout_s=1)
        with anyio.move_on_after(self.exit_timeout_s):
            for process in self._processes.values():
                await process.wait()

    async def _tell_all(self, message: Shutdown, timeout_s: float) -> None:
        """Best effort: a rank that is gone cannot be told anything."""
        for stream in self._streams.values():
            with (
                anyio.move_on_after(timeout_s),
                contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
            ):
                await stream.send(message)

    async def _kill_all(self) -> None:
        """Terminate, then kill, every process this engine started."""
        self._stopping = True
        alive = [p for p in self._processes.values() if p.returncode is None]
        for process in alive:
            _signal(process, signal.SIGTERM)
        with anyio.move_on_after(3):
            for process in alive:
                await process.wait()
        for process in alive:
            if process.returncode is None:
                _signal(process, signal.SIGKILL)
                await process.wait()


def _signal(process: Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"died (killed by signal {signal.Signals(-code).name})"
    return f"exited with status {code}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
