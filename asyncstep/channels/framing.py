"""Typed messages over a byte stream, the one framing of asyncstep's two
connections, and the handshake that opens a connection anyone could reach.

:class:`MessageStream`: msgspec structs, msgpack on the wire (never pickle),
each frame a 4-byte big-endian length then the payload, at most
:data:`MAX_FRAME_BYTES`. It reads up to :data:`RECEIVE_BYTES` at a time: the
frames already there are taken without another read (one read, and one
wait on the event loop, for a batch of small frames). The engine's control connections to its ranks
(:mod:`asyncstep.channels.control`, TCP) and the front end's socket pair to
its engine core (:mod:`asyncstep.engine.messages.core_messages`) both use it.

A TCP listener can be reached by any process of the machine (or of the
network, off loopback), so a control connection authenticates first, with a
per-launch secret, before any other message: an HMAC-SHA256
challenge-response both ways. The listening side (:func:`accept_peer`) sends
a fresh nonce; the connecting side (:func:`connect_peer`) answers with a
nonce of its own and ``HMAC(secret, "connect" + challenge + nonce)``; the
listening side checks it in constant time, then proves itself with
``HMAC(secret, "accept" + nonce + challenge)``, which the connecting side
checks. The secret never crosses the wire, and an answer cannot be replayed
(the nonces are fresh) nor reflected (the two directions have different
labels). A peer that fails gets :class:`AuthenticationError` on the other
side, which closes the connection. Handshake frames are at most
:data:`HANDSHAKE_FRAME_BYTES`: a stranger cannot make the listener buffer a
large frame. A socket pair (the engine core's) has no address anyone could
connect to and needs no handshake.

The secret is text: :func:`new_secret` makes one (256 random bits);
processes started by the engine get it in the environment variable
:data:`SECRET_ENV`, never on the command line (``/proc/PID/cmdline`` is
readable by every user, ``/proc/PID/environ`` only by the process's own).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar

import msgspec
from anyio import EndOfStream, IncompleteRead
from anyio.abc import ByteStream

from asyncstep.config import config_error
from asyncstep.errors import ConfigError

#: Largest frame accepted (a step of a huge batch is far below this).
MAX_FRAME_BYTES = 256 << 20
#: Bytes asked of the stream at a time (more when a frame needs more).
RECEIVE_BYTES = 1 << 16
#: Largest handshake frame (they are ~80 bytes).
HANDSHAKE_FRAME_BYTES = 1024
#: The environment variable that holds the control-plane secret.
SECRET_ENV = "ASYNCSTEP_SECRET"
NONCE_BYTES = 32
_HEADER = struct.Struct("!I")
_CONNECT = b"asyncstep connect"
_ACCEPT = b"asyncstep accept"

Received = TypeVar("Received")


class ProtocolError(Exception):
    """The peer sent something that is not a message of this protocol."""


class AuthenticationError(ProtocolError):
    """The peer does not know the secret (or does not speak the handshake)."""


class MessageStream(Generic[Received]):
    """Length-framed msgspec messages over a byte stream; it receives the
    messages of ``receives`` (a struct type or a union of tagged ones)."""

    def __init__(self, stream: ByteStream, receives: Any) -> None:
        self._stream = stream
        #: Received, not taken yet.
        self._buffer = bytearray()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Received] = msgspec.msgpack.Decoder(receives)

    async def send(self, message: msgspec.Struct) -> None:
        await self.send_encoded(self._encoder.encode(message))

    async def send_encoded(self, payload: bytes) -> None:
        """Send a message already msgpack-encoded (one encoding for many peers)."""
        await self._stream.send(_HEADER.pack(len(payload)) + payload)

    async def receive_frame(self, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
        """The next frame's payload, undecoded; :class:`ProtocolError` if it
        is longer than ``max_bytes`` (nothing more is read then)."""
        (size,) = _HEADER.unpack(await self._take(_HEADER.size))
        if size > max_bytes:
            raise ProtocolError(f"frame of {size} bytes is larger than {max_bytes}")
        return await self._take(size)

    async def _take(self, nbytes: int) -> bytes:
        """The next ``nbytes`` bytes; ``IncompleteRead`` if the stream ends first."""
        buffer = self._buffer
        while len(buffer) < nbytes:
            try:
                buffer += await self._stream.receive(max(RECEIVE_BYTES, nbytes - len(buffer)))
            except EndOfStream as exc:
                raise IncompleteRead from exc
        taken = bytes(buffer[:nbytes])
        del buffer[:nbytes]
        return taken

    async def receive(self) -> Received:
        """The next message; ``anyio.EndOfStream``/``IncompleteRead`` when the
        peer left. One that does not decode raises :class:`ProtocolError`; an
        :class:`~asyncstep.config.EngineConfig` in it that fails its checks,
        that check's :class:`ConfigError`."""
        payload = await self.receive_frame()
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            if isinstance(exc.__cause__, ConfigError):
                raise config_error(exc) from None
            raise ProtocolError(f"bad message: {exc}") from None

    async def aclose(self) -> None:
        await self._stream.aclose()


# -- the handshake ----------------------------------------------------------------

Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
Mac = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]


class Challenge(msgspec.Struct, frozen=True, tag=True):
    nonce: Nonce


class Answer(msgspec.Struct, frozen=True, tag=True):
    nonce: Nonce
    mac: Mac


class Proof(msgspec.Struct, frozen=True, tag=True):
    mac: Mac


_M = TypeVar("_M", Challenge, Answer, Proof)


def new_secret() -> str:
    """A fresh secret for one launch."""
    return secrets.token_hex(32)


def read_secret_file(path: str | Path) -> str:
    """The secret in ``path`` (surrounding whitespace dropped); ``ConfigError``
    if the file cannot be read or holds nothing."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the secret file {path}: {exc.strerror}") from None
    if not secret:
        raise ConfigError(f"the secret file {path} is empty")
    return secret


async def accept_peer(stream: MessageStream[Any], secret: str) -> None:
    """The listening side of the handshake: challenge the peer, check its
    answer, prove that this side knows the secret too. Raises
    :class:`AuthenticationError` (or, when the peer leaves,
    ``anyio.EndOfStream``/``IncompleteRead``) on failure; the caller then
    closes the connection."""
    challenge = secrets.token_bytes(NONCE_BYTES)
    await stream.send(Challenge(challenge))
    answer = await _receive_handshake(stream, Answer)
    expected = _mac(secret, _CONNECT, challenge, answer.nonce)
    if not hmac.compare_digest(answer.mac, expected):
        raise AuthenticationError("the peer does not know the secret")
    await stream.send(Proof(_mac(secret, _ACCEPT, answer.nonce, challenge)))


async def connect_peer(stream: MessageStream[Any], secret: str) -> None:
    """The connecting side of the handshake: answer the listener's challenge,
    then check its proof. Raises :class:`AuthenticationError` when the
    listener does not know the secret."""
    challenge = await _receive_handshake(stream, Challenge)
    nonce = secrets.token_bytes(NONCE_BYTES)
    await stream.send(Answer(nonce, _mac(secret, _CONNECT, challenge.nonce, nonce)))
    proof = await _receive_handshake(stream, Proof)
    if not hmac.compare_digest(proof.mac, _mac(secret, _ACCEPT, nonce, challenge.nonce)):
        raise AuthenticationError("the listener does not know the secret")


async def _receive_handshake(stream: MessageStream[Any], kind: type[_M]) -> _M:
    try:
        payload = await stream.receive_frame(HANDSHAKE_FRAME_BYTES)
    except ProtocolError as exc:
        raise AuthenticationError(f"no {kind.__name__}: {exc}") from None
    try:
        return msgspec.msgpack.decode(payload, type=kind)
    except msgspec.DecodeError as exc:
        raise AuthenticationError(f"no {kind.__name__}: {exc}") from None


def _mac(secret: str, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.digest(secret.encode(), label + first + second, hashlib.sha256)
