"""The control plane between the engine and its ranks: typed messages
(msgspec structs, msgpack on the wire, never pickle), framed with a 4-byte
length over any AnyIO byte stream (a TCP connection).

A rank connects to the engine and says :class:`Hello`; the engine answers
with :class:`RankSetup`; the rank loads its shard and reports
:class:`RankReady` (how many KV blocks fit); the engine sends
:class:`InitKVCache` with the smallest count, then one :class:`Step` per
scheduler step to every rank. The driver rank (first TP rank of the last
pipeline stage) answers each with :class:`StepOutput`. :class:`RankFailed`
carries a rank's error; :class:`Shutdown` ends a rank.
"""

from __future__ import annotations

import struct

import msgspec
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from asyncstep.datatypes import ModelRunnerOutput, SchedulerOutput

#: Largest frame accepted (a step of a huge batch is far below this).
MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct("!I")


class RankSpec(msgspec.Struct, frozen=True):
    """What a rank needs to build its shard (the engine's configuration)."""

    model: str | None
    load_format: str
    dtype: str
    device: str
    max_model_len: int
    seed: int
    block_size: int
    num_blocks: int | None
    kv_cache_memory_gib: float
    gpu_memory_utilization: float
    max_num_seqs: int
    #: Requests that may run at once (their KV cache must fit).
    max_num_running_reqs: int
    max_num_batched_tokens: int
    #: sys.setswitchinterval while serving (None: Python's).
    gil_switch_interval_s: float | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    sequence_parallel: bool
    #: The runner keeps sampled ids on the device for the next step.
    async_scheduling: bool = False
    #: CompilationConfig's fields (CUDA graphs, attention backend).
    cudagraph_mode: str = "NONE"
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    attention_backend: str = "auto"
    fused_kernels: bool = True
    enable_ubatching: bool = False
    ubatch_decode_threshold: int = 32
    ubatch_prefill_threshold: int = 512
    cudagraph_stand_in: bool = False
    #: ParallelConfig.pp_tensor_lanes.
    pp_tensor_lanes: bool = True


class Hello(msgspec.Struct, frozen=True, tag=True):
    rank: int
    world_size: int
    pid: int
    host: str


class RankSetup(msgspec.Struct, frozen=True, tag=True):
    spec: RankSpec
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
        """The next message; ``anyio.EndOfStream``/``IncompleteRead`` when the peer left."""
        (size,) = _HEADER.unpack(await self._receive.receive_exactly(_HEADER.size))
        if size > MAX_FRAME_BYTES:
            raise ProtocolError(f"control frame of {size} bytes is larger than {MAX_FRAME_BYTES}")
        payload = await self._receive.receive_exactly(size)
        try:
            return self._decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad control message: {exc}") from None

    async def aclose(self) -> None:
        await self._stream.aclose()
