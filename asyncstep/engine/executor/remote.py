"""Ranks in other processes, driven over the control plane.

:class:`RemoteRanks` has the same contract as the in-process
:class:`~asyncstep.nursery.RankActor`: scheduler outputs in, the driver
rank's model runner outputs out. It listens for the ranks' connections
(loopback unless told otherwise), starts them itself on this machine
(``launch_ranks``) or waits for ranks started elsewhere (torchrun), hands them
the setup, and then broadcasts every step to all of them.

Nothing is open to strangers. A connection is a rank only once it has passed
the handshake of :mod:`asyncstep.channels.framing` with the launch's secret:
a new one for ranks started here (in their environment, ``ASYNCSTEP_SECRET``),
for ranks started elsewhere ``ASYNCSTEP_SECRET`` of this process or, without
it, a new one written to a private file whose path is logged. A connection
that fails it (or is silent for ``handshake_timeout_s``) is logged and
dropped; connections are admitted concurrently, so none holds up the ranks.
A listen address off loopback is logged as a warning. Ranks started here
rendezvous on a store that rank 0 serves on a loopback socket the engine
bound and hands it (no port is chosen, freed and reused), and their gloo /
NCCL sockets bind loopback (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``,
unless set).

Failure: the first rank error (a :class:`RankFailed` message, a closed
connection, or a process that exits) ends :meth:`RemoteRanks.run` with a
:class:`RankError` naming the rank; on the way out every process it started
is terminated, then killed, so none is left behind.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
from anyio.abc import Listener, Process, SocketAttribute, SocketStream, TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.channels.control import (
    ControlMessage,
    ControlStream,
    Grammar,
    Hello,
    InitKVCache,
    RankFailed,
    RankReady,
    RankSetup,
    Shutdown,
    Step,
    StepOutput,
)
from asyncstep.channels.framing import (
    SECRET_ENV,
    AuthenticationError,
    ProtocolError,
    accept_peer,
    new_secret,
)
from asyncstep.channels.parallel_state import listening_socket
from asyncstep.config import EngineConfig
from asyncstep.datatypes import GrammarOutput, ModelRunnerOutput, RankInput, WeightReads
from asyncstep.errors import RankError
from asyncstep.logging import get_logger
from asyncstep.logging.spans import span

log = get_logger("engine")

#: What a peer that left looks like.
_PEER_GONE = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)


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
    #: Seconds a connection gets to pass the handshake, and then to say Hello.
    handshake_timeout_s: float = 10.0
    #: The control-plane secret; None: chosen by :meth:`run` (see the module doc).
    secret: str | None = None
    #: RankReady of every rank, once they are ready.
    ready: list[RankReady] = field(default_factory=list)
    _processes: dict[int, Process] = field(default_factory=dict)
    _streams: dict[int, ControlStream] = field(default_factory=dict)
    #: The ranks' rendezvous (None: their own, torchrun's MASTER_ADDR/PORT).
    _init_method: str | None = None
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

    @property
    def weight_reads(self) -> WeightReads | None:
        """The weight bytes a step reads on every rank together (None
        before the ranks are ready)."""
        if not self.ready:
            return None
        return functools.reduce(WeightReads.plus, (r.weight_reads for r in self.ready))

    async def run(
        self,
        inbox: MemoryObjectReceiveStream[RankInput],
        outbox: MemoryObjectSendStream[ModelRunnerOutput],
        *,
        task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start (or await) the ranks, report the KV block count, serve steps
        until ``inbox`` closes, then shut the ranks down."""
        listener = await self._listen()
        secret_file: Path | None = None
        try:
            secret, secret_file = self._launch_secret()
            async with anyio.create_task_group() as tg:
                port = listener.extra(SocketAttribute.local_port)
                with anyio.fail_after(self.connect_timeout_s):
                    await self._admit_all(listener, port, secret, secret_file, tg)
                await listener.aclose()  # every rank is in: nothing more to accept
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
                if secret_file is not None:
                    secret_file.unlink(missing_ok=True)
                if not self._stopping:  # cancelled: tell the ranks still connected
                    self._stopping = True
                    await self._tell_all(Shutdown(), timeout_s=0.5)
                for stream in self._streams.values():
                    await stream.aclose()
                await self._kill_all()

    # -- admit ------------------------------------------------------------

    def _launch_secret(self) -> tuple[str, Path | None]:
        """This launch's secret, and the file it was written to for ranks
        started elsewhere (None when they know it already)."""
        if self.secret is not None:
            return self.secret, None
        if self.launch:
            return new_secret(), None
        if os.environ.get(SECRET_ENV):
            return os.environ[SECRET_ENV], None
        secret = new_secret()
        fd, path = tempfile.mkstemp(prefix="asyncstep-secret-")  # mode 0600
        with os.fdopen(fd, "w") as file:
            file.write(secret + "\n")
        return secret, Path(path)

    async def _listen(self) -> Listener[SocketStream]:
        host, port = self.config.parallel.listen_address
        if not await _is_loopback(host):
            log.warning(
                "the rank control listener is reachable from other machines",
                address=self.config.parallel.listen,
                risk="any host that reaches it can try to pose as a rank; only the "
                f"launch's secret ({SECRET_ENV}) keeps it out, and the traffic (config, "
                "steps) is not encrypted: listen on a trusted network only",
            )
        return await anyio.create_tcp_listener(local_host=host, local_port=port)

    async def _admit_all(
        self,
        listener: Listener[SocketStream],
        port: int,
        secret: str,
        secret_file: Path | None,
        tg: TaskGroup,
    ) -> None:
        """Accept connections (each admitted concurrently) until every rank is
        in, starting the ranks meanwhile when they are ours to start."""
        everyone_in = anyio.Event()

        async def admit(socket_stream: SocketStream) -> None:
            await self._admit(socket_stream, secret, everyone_in)

        async with anyio.create_task_group() as admission:
            admission.start_soon(listener.serve, admit, admission)
            if self.launch:
                await self._spawn(port, secret, tg)
            else:
                how = f"--secret-file {secret_file}" if secret_file else f"({SECRET_ENV} set)"
                log.warning(
                    "waiting for ranks",
                    world_size=self.world_size,
                    address=f"{self.config.parallel.listen_address[0]}:{port}",
                    command=f"python -m asyncstep.rank --engine HOST:{port} {how}",
                )
            await everyone_in.wait()
            admission.cancel_scope.cancel()

    async def _admit(
        self, socket_stream: SocketStream, secret: str, everyone_in: anyio.Event
    ) -> None:
        """One connection: a rank if it passes the handshake and says a Hello
        that fits; a stranger's is logged and closed; a rank's that does not
        fit ends the launch (:class:`RankError`)."""
        peer = _peer(socket_stream)
        stream = ControlStream(socket_stream, ControlMessage)
        admitted = False
        try:
            try:
                with anyio.fail_after(self.handshake_timeout_s):
                    await accept_peer(stream, secret)
            except (AuthenticationError, TimeoutError, *_PEER_GONE) as exc:
                reason = str(exc) or type(exc).__name__
                log.warning("refused a control connection", peer=peer, reason=reason)
                return
            with anyio.fail_after(self.handshake_timeout_s):
                hello = await self._receive_hello(stream, peer)
            self._check(hello)
            self._streams[hello.rank] = stream
            admitted = True
            log.debug("rank connected", rank=hello.rank, pid=hello.pid, host=hello.host, peer=peer)
            if len(self._streams) == self.world_size:
                everyone_in.set()
        finally:
            if not admitted:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()

    async def _receive_hello(self, stream: ControlStream, peer: str) -> Hello:
        try:
            hello = await stream.receive()
        except _PEER_GONE:
            raise RankError(f"a rank at {peer} left before its Hello") from None
        except ProtocolError as exc:
            raise RankError(f"a rank at {peer} opened with a bad message: {exc}") from None
        if not isinstance(hello, Hello):
            raise RankError(f"a rank opened with {type(hello).__name__}, not Hello")
        return hello

    def _check(self, hello: Hello) -> None:
        if hello.world_size != self.world_size or not 0 <= hello.rank < self.world_size:
            parallel = self.config.parallel
            raise RankError(
                f"rank {hello.rank} of world {hello.world_size} connected; this engine "
                f"runs {self.world_size} ranks (tp {parallel.tensor_parallel_size} x "
                f"pp {parallel.pipeline_parallel_size})"
            )
        if hello.rank in self._streams:
            raise RankError(f"rank {hello.rank} connected twice")

    # -- start ------------------------------------------------------------

    async def _spawn(self, port: int, secret: str, tg: TaskGroup) -> None:
        """Start every rank here. Rank 0 inherits the socket its rendezvous
        store will serve on, bound to loopback now: the port is never free
        for another process to take between its choice and its use."""
        parallel = self.config.parallel
        engine_host = _connect_host(parallel.listen_address[0])
        env = _rank_env(secret)
        store = listening_socket("127.0.0.1", 0)
        with store:
            self._init_method = f"tcp://127.0.0.1:{store.getsockname()[1]}"
            for rank in range(self.world_size):
                command = [
                    sys.executable,
                    "-m",
                    "asyncstep.rank",
                    "--engine",
                    f"{engine_host}:{port}",
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
                pass_fds: tuple[int, ...] = ()
                if rank == 0:
                    command += ["--store-fd", str(store.fileno())]
                    pass_fds = (store.fileno(),)
                process = await anyio.open_process(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=None,
                    env=env,
                    pass_fds=pass_fds,
                )
                self._processes[rank] = process
                tg.start_soon(self._watch, rank, process)
        log.info("ranks started", world_size=self.world_size, pids=self.pids)

    async def _set_up(self) -> int:
        # One encoding of the whole config for every rank.
        setup = msgspec.msgpack.encode(RankSetup(self.config, self._init_method))
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

    async def _broadcast(self, inbox: MemoryObjectReceiveStream[RankInput]) -> None:
        encoder = msgspec.msgpack.Encoder()
        async with inbox:
            async for message in inbox:
                # The span (encode + a send to each rank) pairs with each
                # rank's ``step_in`` marker: the engine-to-rank hop.
                with span("broadcast", "engine", step=message.step_id):
                    if isinstance(message, GrammarOutput):
                        frame = encoder.encode(Grammar(message))
                    else:
                        frame = encoder.encode(Step(message))
                    for rank, stream in self._streams.items():
                        try:
                            await stream.send_encoded(frame)
                        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                            raise RankError(await self._death_notice(rank)) from None

    async def _read_rank(
        self, rank: int, stream: ControlStream, outbox: MemoryObjectSendStream[ModelRunnerOutput]
    ) -> None:
        while True:
            message = await self._receive(rank, stream)
            if isinstance(message, StepOutput) and rank == self.driver_rank:
                await outbox.send(message.output)
            else:
                raise RankError(f"rank {rank} sent an unexpected {type(message).__name__}")

    async def _receive(self, rank: int, stream: ControlStream) -> object:
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


def _peer(stream: SocketStream) -> str:
    try:
        address = stream.extra(SocketAttribute.remote_address)
    except anyio.TypedAttributeLookupError:
        return "?"
    if isinstance(address, tuple):
        return f"{address[0]}:{address[1]}"
    return str(address)


async def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one."""
    try:
        infos = await anyio.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def _connect_host(listen_host: str) -> str:
    """Where ranks started here reach a listener on ``listen_host``."""
    return "127.0.0.1" if listen_host in ("", "0.0.0.0", "::") else listen_host


def _rank_env(secret: str) -> dict[str, str]:
    """The environment of a rank started here: the secret, and gloo's and
    NCCL's sockets on loopback (every rank is on this machine) unless the
    caller chose an interface."""
    env = {**os.environ, SECRET_ENV: secret}
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), None)
    if loopback is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", loopback)
        env.setdefault("NCCL_SOCKET_IFNAME", loopback)
    return env
