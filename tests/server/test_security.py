"""No socket is open to strangers (issue 14).

The handshake of :mod:`asyncstep.channels.framing` on a socket pair: the
right secret passes both ways; a wrong one, a replayed answer, a forged
proof, a message of the old protocol and an oversized frame are refused.
Then one TP = 2 launch (an in-process engine, so that the test can get
between the engine and its ranks) under attack: strangers connect to the
control listener before any rank (a wrong secret, a Hello without the
handshake, a 4 GiB frame, one that says nothing) and another process tries to
take the rendezvous store's port between its choice and its use; each
stranger is refused and logged, the port cannot be taken, the launch
completes, and every socket that listens is on loopback. (The default
launch, the engine core in its own process, is checked the same way in
``test_engine_process.py``: once its ranks are in, the core listens on nothing.)
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
from distributed import free_port, listening_sockets

import asyncstep
from asyncstep import SamplingParams
from asyncstep.channels.control import ControlMessage, ControlStream, Hello
from asyncstep.channels.framing import (
    _CONNECT,
    SECRET_ENV,
    Answer,
    AuthenticationError,
    Challenge,
    Proof,
    _mac,
    accept_peer,
    connect_peer,
    new_secret,
)
from asyncstep.channels.parallel_state import open_tcp_store
from asyncstep.config import EngineConfig, ParallelConfig
from asyncstep.engine.executor.remote import RemoteRanks
from asyncstep.nursery.rank_main import parse_args

SECRET = "the secret of this launch"
TINY: dict[str, Any] = {"load_format": "dummy", "device": "cpu", "dtype": "float32"}
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LOOPBACK = {"127.0.0.1", "::1"}

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="lists sockets from /proc (Linux)"
)


# -- helpers ------------------------------------------------------------------------


@pytest.fixture
def warnings_logged() -> Iterator[list[dict[str, Any]]]:
    """The event dicts of asyncstep's warnings while the test runs (whatever
    an earlier test configured)."""
    events: list[dict[str, Any]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if isinstance(record.msg, dict):
                events.append(record.msg)

    logger = logging.getLogger("asyncstep")
    level = logger.level
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def stream_pair() -> tuple[ControlStream, ControlStream]:
    """Two ends of a socket pair: (the listening side, the connecting side)."""
    a, b = socket.socketpair()
    return (
        ControlStream(await anyio.abc.SocketStream.from_socket(a), ControlMessage),
        ControlStream(await anyio.abc.SocketStream.from_socket(b), ControlMessage),
    )


# -- the handshake --------------------------------------------------------------------


@pytest.mark.trio
async def test_the_right_secret_passes_both_ways_and_messages_follow() -> None:
    engine, rank = await stream_pair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(accept_peer, engine, SECRET)
        await connect_peer(rank, SECRET)
    await rank.send(Hello(1, 2, 3, "host"))
    assert await engine.receive() == Hello(1, 2, 3, "host")


@pytest.mark.trio
async def test_a_wrong_secret_is_refused_and_gets_no_proof() -> None:
    engine, rank = await stream_pair()
    refused: list[Exception] = []

    async def listen() -> None:
        try:
            await accept_peer(engine, SECRET)
        except AuthenticationError as exc:
            refused.append(exc)
            await engine.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(listen)
        with pytest.raises((anyio.EndOfStream, anyio.IncompleteRead)):
            await connect_peer(rank, "a guess")
    assert [str(e) for e in refused] == ["the peer does not know the secret"]


@pytest.mark.trio
async def test_a_listener_without_the_secret_is_refused() -> None:
    """A listener that took the engine's address cannot pose as the engine."""
    impostor, rank = await stream_pair()

    async def pose() -> None:
        await impostor.send(Challenge(os.urandom(32)))
        await impostor.receive_frame()  # the answer: it cannot check it
        await impostor.send(Proof(os.urandom(32)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(pose)
        with pytest.raises(AuthenticationError, match="the listener does not know the secret"):
            await connect_peer(rank, SECRET)


@pytest.mark.trio
async def test_a_recorded_answer_does_not_pass_again() -> None:
    engine, rank = await stream_pair()
    async with anyio.create_task_group() as tg:
        tg.start_soon(accept_peer, engine, SECRET)
        challenge = msgspec.msgpack.decode(await rank.receive_frame(), type=Challenge)
        # What an eavesdropper saw: a right answer to that challenge.
        nonce = os.urandom(32)
        recorded = Answer(nonce, _mac(SECRET, _CONNECT, challenge.nonce, nonce))
        await rank.send(recorded)
        await rank.receive_frame()  # the proof: it passed
    engine, replayer = await stream_pair()

    async def replay() -> None:
        await replayer.receive_frame()  # a fresh challenge
        await replayer.send(recorded)

    async with anyio.create_task_group() as tg:
        tg.start_soon(replay)
        with pytest.raises(AuthenticationError, match="the peer does not know the secret"):
            await accept_peer(engine, SECRET)


@pytest.mark.trio
@pytest.mark.parametrize(
    "opening,reason",
    [
        (msgspec.msgpack.encode(Hello(0, 2, 1, "h")), "no Answer: Invalid value 'Hello'"),
        (b"\xc1", "no Answer: "),
    ],
    ids=["hello", "not msgpack"],
)
async def test_a_peer_that_skips_the_handshake_is_refused(opening: bytes, reason: str) -> None:
    engine, stranger = await stream_pair()
    await stranger.send_encoded(opening)
    with pytest.raises(AuthenticationError, match=reason):
        await accept_peer(engine, SECRET)


@pytest.mark.trio
async def test_an_oversized_handshake_frame_is_refused_unread() -> None:
    ours, stranger = socket.socketpair()
    engine = ControlStream(await anyio.abc.SocketStream.from_socket(ours), ControlMessage)
    with stranger:
        stranger.sendall(struct.pack("!I", 0xFFFF_FFFF))  # 4 GiB announced, none sent
        with pytest.raises(AuthenticationError, match="larger than 1024"):
            await accept_peer(engine, SECRET)


# -- secrets, warnings, the store -----------------------------------------------------


def test_a_rank_reads_its_secret_from_a_file_or_the_environment_not_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--engine", "127.0.0.1:5555"])
    assert f"no control secret: set {SECRET_ENV} or give --secret-file" in capsys.readouterr().err
    monkeypatch.setenv(SECRET_ENV, "from the environment")
    assert parse_args(["--engine", "h:1"]).secret == "from the environment"
    assert SECRET_ENV not in os.environ  # the rank's children do not inherit it
    (tmp_path / "secret").write_text("from the file\n")
    args = parse_args(["--engine", "h:1", "--secret-file", str(tmp_path / "secret")])
    assert args.secret == "from the file"


def test_an_engine_waiting_for_ranks_writes_a_new_secret_to_a_private_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    external = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, launch_ranks=False))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    secret, path = RemoteRanks(external)._launch_secret()
    assert path is not None
    try:
        assert path.read_text().strip() == secret and len(secret) == 64
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        path.unlink()
    monkeypatch.setenv(SECRET_ENV, "shared")
    assert RemoteRanks(external)._launch_secret() == ("shared", None)
    launched = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2))
    secret, path = RemoteRanks(launched)._launch_secret()
    assert path is None and secret != "shared"  # a new one for every launch
    assert new_secret() != new_secret()


@pytest.mark.trio
@pytest.mark.parametrize(
    "listen,warned", [("127.0.0.1:0", False), ("localhost:0", False), ("0.0.0.0:0", True)]
)
async def test_a_listener_off_loopback_is_a_warning(
    listen: str, warned: bool, warnings_logged: list[dict[str, Any]]
) -> None:
    config = EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2, listen=listen))
    async with await RemoteRanks(config)._listen():
        pass
    events = [e for e in warnings_logged if e["event"].startswith("the rank control listener")]
    assert len(events) == warned
    if warned:
        assert events[0]["address"] == listen and SECRET_ENV in events[0]["risk"]


@pytest.mark.parametrize("how", ["tcp", "env"])
def test_rank_zero_serves_the_store_on_the_master_address_only(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's TCPStore alone listens on every interface (``::``)."""
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    init_method = f"tcp://127.0.0.1:{port}" if how == "tcp" else "env://"
    timeout = datetime.timedelta(seconds=10)
    store = open_tcp_store(init_method, 0, 1, timeout)
    assert store is not None
    try:
        store.set("k", "v")
        ours = [(a, p) for _, a, p in listening_sockets([os.getpid()]) if p == port]
        assert ours == [("127.0.0.1", port)]
    finally:
        del store
    assert open_tcp_store("file:///tmp/x", 0, 1, timeout) is None


# -- launches -------------------------------------------------------------------------


class Strangers:
    """Everything that tries its luck during the launch, and what it got."""

    def __init__(self) -> None:
        self.outcomes: dict[str, list[str]] = {}
        self.silent: anyio.abc.SocketStream | None = None
        self.squatted: list[socket.socket] = []
        self.squat_errors: list[int] = []
        self.rank_pids: list[int] = []

    async def connect(self, port: int) -> None:
        """Strangers on the control port, before any rank exists: each is
        answered (a challenge) and dropped."""
        self.silent = await anyio.connect_tcp("127.0.0.1", port)
        with anyio.fail_after(10):
            self.outcomes["wrong secret"] = await self._wrong_secret(port)
            self.outcomes["hello"] = await self._opening(port, Hello(0, 2, 1, "x"))
            self.outcomes["huge frame"] = await self._opening(port, None)

    async def _wrong_secret(self, port: int) -> list[str]:
        stream = ControlStream(await anyio.connect_tcp("127.0.0.1", port), ControlMessage)
        try:
            await connect_peer(stream, "a guess")
        except (anyio.EndOfStream, anyio.IncompleteRead) as exc:
            return ["Challenge", type(exc).__name__]
        finally:
            await stream.aclose()
        return ["Challenge", "Proof"]

    async def _opening(self, port: int, message: Hello | None) -> list[str]:
        socket_stream = await anyio.connect_tcp("127.0.0.1", port)
        if message is None:
            await socket_stream.send(struct.pack("!I", 0xFFFF_FFFF))
        else:
            await socket_stream.send(_frame(msgspec.msgpack.encode(message)))
        return await _read_until_closed(ControlStream(socket_stream, ControlMessage))

    def squat(self, kwargs: dict[str, Any]) -> None:
        """Try to take the rendezvous port a rank is about to be told."""
        ports = set()
        if "MASTER_PORT" in (kwargs.get("env") or {}):
            ports.add(int(kwargs["env"]["MASTER_PORT"]))
        for fd in kwargs.get("pass_fds", ()):
            with socket.socket(fileno=os.dup(fd)) as inherited:
                ports.add(inherited.getsockname()[1])
        for port in ports:
            squatter = socket.socket()
            try:
                squatter.bind(("127.0.0.1", port))
                squatter.listen()
            except OSError as exc:
                squatter.close()
                self.squat_errors.append(exc.errno)
            else:
                self.squatted.append(squatter)


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


async def _read_until_closed(stream: ControlStream) -> list[str]:
    """The names of the frames a stranger got before the engine hung up."""
    got = []
    with anyio.fail_after(10):
        while True:
            try:
                frame = await stream.receive_frame()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
                got.append(type(exc).__name__)
                break
            kind = Challenge | Proof | ControlMessage
            got.append(type(msgspec.msgpack.decode(frame, type=kind)).__name__)
    await stream.aclose()
    return got


@pytest.mark.trio
async def test_a_launch_under_attack_completes_and_listens_on_loopback_only(
    monkeypatch: pytest.MonkeyPatch, warnings_logged: list[dict[str, Any]]
) -> None:
    strangers = Strangers()
    spawn = anyio.open_process

    async def open_process(command: list[str], **kwargs: Any) -> anyio.abc.Process:
        if not strangers.rank_pids:  # before the first rank starts
            strangers.squat(kwargs)
            await strangers.connect(int(command[command.index("--engine") + 1].split(":")[-1]))
        process = await spawn(command, **kwargs)
        strangers.rank_pids.append(process.pid)
        return process

    monkeypatch.setattr(anyio, "open_process", open_process)
    try:
        async with asyncstep.open_engine(
            "tiny-llama", tensor_parallel_size=2, engine_process=False, **TINY
        ) as engine:
            output = await engine.generate([5, 9, 2], PARAMS)
            listening = listening_sockets([os.getpid(), *strangers.rank_pids])
            assert strangers.silent is not None
            silent = await _read_until_closed(ControlStream(strangers.silent, ControlMessage))
    finally:
        for squatter in strangers.squatted:
            squatter.close()
    assert len(output.token_ids) == PARAMS.max_tokens
    assert strangers.squat_errors == [errno.EADDRINUSE] and not strangers.squatted
    assert strangers.outcomes == {
        "wrong secret": ["Challenge", "IncompleteRead"],
        "hello": ["Challenge", "IncompleteRead"],
        "huge frame": ["Challenge", "IncompleteRead"],
    }
    assert silent == ["Challenge", "IncompleteRead"]  # dropped once the ranks were in
    refused = [e for e in warnings_logged if e["event"] == "refused a control connection"]
    assert [e["reason"] for e in refused] == [
        "the peer does not know the secret",
        "no Answer: Invalid value 'Hello' - at `$.type`",
        "no Answer: frame of 4294967295 bytes is larger than 1024",
    ]
    assert all(e["peer"].startswith("127.0.0.1:") for e in refused)
    # The control listener closed once the ranks were in; gloo's and the store's remain.
    assert {pid for pid, _, _ in listening} == set(strangers.rank_pids)
    assert {address for _, address, _ in listening} <= LOOPBACK, listening
