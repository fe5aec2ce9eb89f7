"""The control plane between the engine and its ranks: typed messages
(msgspec structs, msgpack on the wire, never pickle), framed with a 4-byte
length over any AnyIO byte stream (a TCP connection).

A rank connects to the engine and says :class:`Hello`; the engine answers
with :class:`RankSetup` (its whole :class:`~asyncstep.config.EngineConfig`);
the rank loads its shard and reports :class:`RankReady` (how many KV blocks
fit); the engine sends :class:`InitKVCache` with the smallest count, then one
:class:`Step` per scheduler step to every rank. The driver rank (first TP
rank of the last pipeline stage) answers each with :class:`StepOutput`.
:class:`RankFailed` carries a rank's error; :class:`Shutdown` ends a rank.
"""

from __future__ import annotations

import struct

import msgspec
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from asyncstep.config import EngineConfig, config_error
from asyncstep.datatypes import ModelRunnerOutput, SchedulerOutput
from asyncstep.errors import ConfigError

#: Largest frame accepted (a step of a huge batch is far below this).
MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct("!I")


class Hello(msgspec.Struct, frozen=True, tag=True):
    rank: int
    world_size: int
    pid: int
    host: str


class RankSetup(msgspec.Struct, frozen=True, tag=True):
    #: The engine's whole configuration, ``model.max_model_len`` resolved.
    config: EngineConfig
    #: torch.distributed rendezvous, e.g. ``tcp://127.0.0.1:29500``; None: the
    #: rank's own (torchrun's MASTER_ADDR/MASTER_PORT).
    init_method: str | None


class RankReady(msgspec.Struct, frozen=True, tag=True):
    rank: int
    #: KV blocks this rank's memory holds.
    num_blocks: int
    weight_bytes: int
    device: str


class InitKVCache(msgspec.Struct, frozen=True, tag=True):
    num_blocks: int


class Step(msgspec.Struct, frozen=True, tag=True):
    scheduler_output: SchedulerOutput


class StepOutput(msgspec.Struct, frozen=True, tag=True):
    output: ModelRunnerOutput


class RankFailed(msgspec.Struct, frozen=True, tag=True):
    rank: int
    error: str


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


ControlMessage = (
    Hello | RankSetup | RankReady | InitKVCache | Step | StepOutput | RankFailed | Shutdown
)


class ProtocolError(Exception):
    """A peer sent something that is not a control message."""


class MessageStream:
    """Length-framed control messages over a byte stream."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._receive = BufferedByteReceiveStream(stream)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ControlMessage)

    async def send(self, message: ControlMessage) -> None:
        await self.send_encoded(self._encoder.encode(message))

    async def send_encoded(self, payload: bytes) -> None:
        """Send a message already msgpack-encoded (one encoding for many ranks)."""
        await self._stream.send(_HEADER.pack(len(payload)) + payload)

    async def receive(self) -> ControlMessage:
        """The next message; ``anyio.EndOfStream``/``IncompleteRead`` when the peer
        left. A message that does not decode raises :class:`ProtocolError`; an
        :class:`EngineConfig` in it that fails its checks, that check's
        :class:`ConfigError`."""
        (size,) = _HEADER.unpack(await self._receive.receive_exactly(_HEADER.size))
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(f"control frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
        payload = await self._receive.receive_exactly(size)
        try:
            return self._decoder.decode(payload)
        except msgspec.ValidationError as exc:
            if isinstance(exc.__cause__, ConfigError):
                raise config_error(exc) from None
            raise ProtocolError(f"bad control message: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad control message: {exc}") from None

    async def aclose(self) -> None:
        await self._stream.aclose()
