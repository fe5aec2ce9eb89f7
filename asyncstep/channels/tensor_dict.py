"""The pipeline-parallel tensor-dict channel: vLLM's ``send_tensor_dict`` /
``recv_tensor_dict`` and ``GPUWorker``'s PP transfer, on asyncstep's types.

Wire protocol, per step, from stage ``i`` TP rank ``j`` to stage ``i + 1``
TP rank ``j`` (the PP group's ``next_rank``: one "lane" per TP rank):

1. Metadata, over the PP group's gloo **CPU group**: a msgpack-encoded
   :class:`TensorDictMetadata` in a fixed-size uint8 tensor (4-byte
   little-endian length, then the payload; :data:`METADATA_BYTES` by default,
   the same on both stages). No pickle.
2. The tensors, over the PP group's **device group** (gloo on CPU, NCCL on
   CUDA), one ``isend``/``irecv`` each, in metadata order. Empty tensors travel
   in the metadata only.

Lanes: for a key whose ``all_gather`` flag is true (the default) and whose
``numel`` divides by the TP size, each lane sends only its ``1/TP`` slice of the
flattened tensor and the receiver all-gathers the slices over its TP group
(metadata ``lane=True``). Keys flagged false (already sequence-parallel
scattered: every TP rank holds a different shard) and tensors that do not
divide are sent whole, lane to lane, and not gathered.

Buffer ownership. The sender copies every (slice of a) tensor into a pooled
staging buffer, so the caller's tensors may be reused as soon as
:func:`send_tensor_dict` returns; the buffers go back to the pool only once
every handle completed (:meth:`PendingSend.wait`, or :func:`drain` when
shutting down). The receiver posts its receives into pooled buffers and waits
for them lazily, at first use (:class:`AsyncIntermediateTensors`); the
consumer gives the buffers back with :meth:`AsyncIntermediateTensors.release`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable, Iterator, Mapping

import anyio
import anyio.lowlevel
import anyio.to_thread
import msgspec
import numpy as np
import torch
import torch.distributed as dist

from asyncstep.channels.buffer_pool import BufferPool
from asyncstep.channels.parallel_state import GroupCoordinator, get_pp_group, get_tp_group
from asyncstep.datatypes import IntermediateTensors
from asyncstep.gpu.work import PendingWork, is_cuda
from asyncstep.logging import get_logger

__all__ = [
    "METADATA_BYTES",
    "AsyncIntermediateTensors",
    "PendingSend",
    "TensorDictMetadata",
    "TensorMetadata",
    "decode_metadata",
    "drain",
    "encode_metadata",
    "recv_tensor_dict",
    "send_tensor_dict",
    "warm_up",
]

log = get_logger("channels.tensor_dict")

# torch >= 2.13 renamed all_gather_into_tensor (now deprecated, with a warning).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Size of the metadata message (bytes), the same on every stage.
METADATA_BYTES = 4096
_LENGTH_BYTES = 4


class TensorMetadata(msgspec.Struct, frozen=True, array_like=True):
    """One entry of a tensor dict: enough to allocate the receive buffer."""

    key: str
    #: torch dtype name without ``torch.`` (``"float32"``, ``"int64"``, ...).
    dtype: str
    shape: list[int]
    #: Sent as this lane's ``1/TP`` slice of the flattened tensor; gathered on receipt.
    lane: bool


class TensorDictMetadata(msgspec.Struct, frozen=True):
    step_id: int
    tensors: list[TensorMetadata]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TensorDictMetadata)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"tensor-dict metadata names an unknown dtype {name!r}")
    return dtype


def encode_metadata(
    meta: TensorDictMetadata, out: torch.Tensor | None = None, *, size: int = METADATA_BYTES
) -> torch.Tensor:
    """``meta`` as a ``size``-byte uint8 CPU tensor (written into ``out`` when given).

    Raises ``ValueError`` when it does not fit.
    """
    payload = _ENCODER.encode(meta)
    if out is not None:
        size = out.numel()
    if _LENGTH_BYTES + len(payload) > size:
        raise ValueError(
            f"tensor-dict metadata of step {meta.step_id} is {_LENGTH_BYTES + len(payload)} "
            f"bytes ({len(meta.tensors)} tensors), more than the {size}-byte metadata "
            "message; send fewer or shorter keys, or raise metadata_bytes on every stage"
        )
    if out is None:
        out = torch.zeros(size, dtype=torch.uint8)
    arr = out.numpy()
    arr[:_LENGTH_BYTES] = np.frombuffer(len(payload).to_bytes(_LENGTH_BYTES, "little"), np.uint8)
    arr[_LENGTH_BYTES : _LENGTH_BYTES + len(payload)] = np.frombuffer(payload, np.uint8)
    return out


def decode_metadata(buf: torch.Tensor) -> TensorDictMetadata:
    """The inverse of :func:`encode_metadata`; ``RuntimeError`` on a corrupt message."""
    arr = buf.numpy()
    length = int.from_bytes(arr[:_LENGTH_BYTES].tobytes(), "little")
    if length > arr.size - _LENGTH_BYTES:
        raise RuntimeError(
            f"corrupt tensor-dict metadata: length {length} in a {arr.size}-byte message "
            "(do both stages use the same metadata_bytes?)"
        )
    try:
        return _DECODER.decode(arr[_LENGTH_BYTES : _LENGTH_BYTES + length].tobytes())
    except msgspec.DecodeError as exc:
        raise RuntimeError(f"corrupt tensor-dict metadata: {exc}") from exc


def _check_pp(pp: GroupCoordinator) -> None:
    if pp.world_size < 2 or pp.device_group is None or pp.cpu_group is None:
        raise ValueError(
            "the tensor-dict channel needs a pipeline-parallel group of at least 2 ranks "
            f"(this rank's has {pp.world_size})"
        )


def _posted(work: dist.Work | None, what: str) -> dist.Work:
    if work is None:
        raise RuntimeError(f"{what}: this rank is not a member of the group")
    return work


def warm_up(
    *,
    device: torch.device | str = "cpu",
    pp: GroupCoordinator | None = None,
) -> None:
    """Open the channel's links to both neighbour stages; every rank of the PP
    group calls it once at start (blocking).

    NCCL creates the communicator of a pair of ranks lazily, at their first
    unbatched send/recv, and that first call blocks until the peer makes its
    own (137 ms measured): without a warm-up the first step pays it, and a
    first ``send_tensor_dict`` whose receiver waits on something else first
    deadlocks. One element goes down the chain of stages (stage ``i``
    receives from ``i - 1``, then sends to ``i + 1``), so no pair waits on
    another. Harmless on gloo.
    """
    pp = pp if pp is not None else get_pp_group()
    _check_pp(pp)
    x = torch.zeros(1, device=device)
    if not pp.is_first_rank:
        _posted(dist.irecv(x, src=pp.prev_rank, group=pp.device_group), "irecv").wait()
    if not pp.is_last_rank:
        _posted(dist.isend(x, dst=pp.next_rank, group=pp.device_group), "isend").wait()
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()


# ---------------------------------------------------------------------------
# Send

#: Sends given up on (drain timed out, or posting failed midway). Measured: a
#: gloo send whose Work handle is garbage-collected before it completed is
#: cancelled (the receiver then waits forever), so these stay referenced, with
#: their buffers, for the life of the process.
_UNFINISHED: list[PendingSend] = []
_UNFINISHED_LOCK = threading.Lock()


def _keep_alive(send: PendingSend) -> None:
    with _UNFINISHED_LOCK:
        # Those that completed since (a thread still waited) give their buffers back.
        _UNFINISHED[:] = [s for s in _UNFINISHED if not s._release_if_complete()]
        _UNFINISHED.append(send)


class PendingSend:
    """The in-flight sends of one step: their handles and staging buffers.

    The buffers go back to the pool only once every handle completed
    (:meth:`wait`); until then they stay out of the pool, whatever happens.
    Keep the object until it is :attr:`done`: a gloo send whose handle is
    garbage-collected before it completed is cancelled, and the receiver then
    waits forever (measured). :func:`drain` keeps the sends it gives up on.
    """

    def __init__(
        self,
        *,
        step_id: int,
        dst: int,
        work: PendingWork,
        buffers: Iterable[torch.Tensor],
        pool: BufferPool,
    ) -> None:
        self.step_id = step_id
        self.dst = dst
        self.work = work
        self._buffers = tuple(buffers)
        self._pool = pool
        self._released = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "done" if self._released else f"{self.work!r}"
        return f"PendingSend(step={self.step_id}, dst={self.dst}, {state})"

    @property
    def done(self) -> bool:
        """Every send completed and the buffers are back in the pool."""
        return self._released

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The staging buffers (the metadata message first); do not release them yourself."""
        return self._buffers

    @property
    def error(self) -> BaseException | None:
        return self.work.error

    def _release_if_complete(self) -> bool:
        with self._lock:
            if not self._released and self.work.done:
                for buf in self._buffers:
                    self._pool.release(buf)
                self._released = True
            return self._released

    async def wait(self, *, abandon_on_cancel: bool = True) -> None:
        """Wait (in a worker thread) until every send completed, then give the
        buffers back to the pool.

        Cancellation leaves at once by default: the waiting thread goes on, the
        buffers stay out of the pool, and a later ``wait()`` or :func:`drain`
        picks the wait up (no handle is waited twice). With
        ``abandon_on_cancel=False`` a cancellation is delivered once the sends
        completed. Raises (and keeps the buffers) when a send failed.
        """
        if not self._released:
            await self.work.wait(abandon_on_cancel=abandon_on_cancel)
        else:
            await anyio.lowlevel.checkpoint()
        self._release_if_complete()

    def wait_blocking(self) -> None:
        """:meth:`wait` for a thread that may block."""
        self.work.wait_blocking()
        self._release_if_complete()


def send_tensor_dict(
    tensors: Mapping[str, torch.Tensor] | IntermediateTensors,
    *,
    step_id: int,
    pool: BufferPool,
    pp: GroupCoordinator | None = None,
    tp: GroupCoordinator | None = None,
    dst: int | None = None,
    all_gather: Mapping[str, bool] | None = None,
    metadata_bytes: int = METADATA_BYTES,
) -> PendingSend:
    """Post the sends of one step's tensors to the next stage; never blocks.

    ``pp``/``tp`` default to this process's groups, ``dst`` (a global rank) to
    ``pp.next_rank``. ``all_gather[key]`` (default true) marks a key the lanes
    may split (see the module docstring). The tensors are copied into buffers
    from ``pool`` (on the tensors' devices; a CUDA copy runs on the current
    stream, which the NCCL send waits for), so the caller may reuse them as
    soon as this returns. Await :meth:`PendingSend.wait` to give the buffers
    back. Raises ``ValueError`` (before sending anything) when the metadata
    does not fit ``metadata_bytes``.
    """
    pp = pp if pp is not None else get_pp_group()
    tp = tp if tp is not None else get_tp_group()
    _check_pp(pp)
    dst = pp.next_rank if dst is None else dst
    items = tensors.tensors if isinstance(tensors, IntermediateTensors) else tensors
    tp_size, tp_rank = tp.world_size, tp.rank_in_group
    gather = all_gather or {}

    metas: list[TensorMetadata] = []
    parts: list[torch.Tensor] = []
    for key, tensor in items.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send_tensor_dict: {key!r} is a {type(tensor).__name__}, not a tensor")
        numel = tensor.numel()
        lane = tp_size > 1 and numel > 0 and numel % tp_size == 0 and gather.get(key, True)
        metas.append(TensorMetadata(key, _dtype_name(tensor.dtype), list(tensor.shape), lane))
        if numel == 0:
            continue
        flat = tensor.reshape(-1)
        if lane:
            n = numel // tp_size
            flat = flat.narrow(0, tp_rank * n, n)
        parts.append(flat)
    meta = TensorDictMetadata(step_id=step_id, tensors=metas)
    # Encode before taking buffers: metadata too large leaves nothing behind.
    encode_metadata(meta, size=metadata_bytes)

    buffers: list[torch.Tensor] = []
    works: list[dist.Work] = []
    try:
        meta_buf = pool.acquire((metadata_bytes,), torch.uint8, "cpu")
        buffers.append(meta_buf)
        encode_metadata(meta, meta_buf)
        for part in parts:
            buf = pool.acquire((part.numel(),), part.dtype, part.device)
            buffers.append(buf)
            buf.copy_(part)
        works.append(_posted(dist.isend(meta_buf, dst=dst, group=pp.cpu_group), "isend"))
        for buf in buffers[1:]:
            works.append(_posted(dist.isend(buf, dst=dst, group=pp.device_group), "isend"))
    except BaseException:
        # Sends already posted may still read their buffers: keep those out of
        # the pool, and their handles alive (see _keep_alive).
        for buf in buffers[len(works) :]:
            pool.release(buf)
        if works:
            posted = PendingSend(
                step_id=step_id,
                dst=dst,
                work=PendingWork(works),
                buffers=buffers[: len(works)],
                pool=pool,
            )
            _keep_alive(posted)
            log.warning("pp_send_failed_midway", step=step_id, posted=len(works))
        raise
    device = next((p.device for p in parts if p.is_cuda), None)
    return PendingSend(
        step_id=step_id,
        dst=dst,
        work=PendingWork(works, device=device),
        buffers=buffers,
        pool=pool,
    )


async def drain(pending: Iterable[PendingSend], timeout_s: float) -> int:
    """Wait, shielded from cancellation and for at most ``timeout_s`` seconds,
    until the given sends completed, and give their buffers back.

    Meant for shutdown (a cancelled send task's ``finally``): it runs to the
    end even inside a cancelled scope. Returns how many of the sends completed
    (their buffers are back in the pool); check it against the number given.
    The sends that did not complete in time (or failed) keep their buffers
    out of the pool (the transport may still read them; should one complete
    later, the next ``drain`` or ``wait()`` hands them back), are left with
    ``done == False``, stay referenced (a collected handle would cancel a gloo
    send), and are reported in a warning. ``drain`` raises nothing for them:
    it usually runs while another exception or a cancellation propagates,
    which an exception of its own would hide.
    """
    sends = list(pending)

    async def drain_one(send: PendingSend) -> None:
        try:
            await send.wait(abandon_on_cancel=True)
        except Exception as exc:  # reported below; the buffers stay out of the pool
            log.debug("pp_send_drain_error", step=send.step_id, error=repr(exc))

    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
        async with anyio.create_task_group() as tg:
            for send in sends:
                if not send.done:
                    tg.start_soon(drain_one, send)
    # A wait may have ended just as the deadline struck: give those back too.
    drained = sum(send._release_if_complete() for send in sends)
    if drained < len(sends):
        left = [send for send in sends if not send.done]
        for send in left:
            _keep_alive(send)
        log.warning(
            "pp_send_drain_incomplete",
            drained=drained,
            undrained=len(left),
            steps=[send.step_id for send in left],
            errors=[repr(send.error) for send in left if send.error is not None],
            timeout_s=timeout_s,
            note="their buffers are kept out of the pool",
        )
    return drained


# ---------------------------------------------------------------------------
# Receive


class AsyncIntermediateTensors(IntermediateTensors):
    """The tensors of one received step, waited for at first use.

    The first access to :attr:`tensors` (or ``[key]``) waits for the receives
    (gloo: blocks this thread until they completed; NCCL: makes the current
    stream wait, no host wait) and all-gathers the lane keys over the TP group
    (every TP rank of the stage must use the tensors, in the same order of
    steps). ``await wait()`` does that off the event loop. ``keys()`` and
    ``len()`` need no waiting. :meth:`release` gives the buffers back to the
    pool once the consumer is done with the tensors.
    """

    def __init__(
        self,
        *,
        metadata: TensorDictMetadata,
        src: int,
        tp: GroupCoordinator,
        device: torch.device,
        work: PendingWork,
        received: list[tuple[TensorMetadata, torch.Tensor | None]],
        pool: BufferPool,
    ) -> None:
        # IntermediateTensors.__init__ is not called: ``tensors`` is a property here.
        self.metadata = metadata
        self.step_id = metadata.step_id
        self.src = src
        self.work = work
        self._tp = tp
        self._device = device
        self._received = received
        self._buffers = [buf for _, buf in received if buf is not None]
        self._pool = pool
        self._tensors: dict[str, torch.Tensor] | None = None
        self._released = False
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        state = "released" if self._released else "ready" if self.ready else "pending"
        return f"AsyncIntermediateTensors(step={self.step_id}, keys={self.keys()}, {state})"

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self._materialize()

    @tensors.setter
    def tensors(self, value: dict[str, torch.Tensor]) -> None:
        raise AttributeError("AsyncIntermediateTensors.tensors cannot be replaced")

    @property
    def ready(self) -> bool:
        """The tensors have been waited for (and gathered)."""
        return self._tensors is not None

    def keys(self) -> list[str]:
        return [m.key for m in self.metadata.tensors]

    def __len__(self) -> int:
        return len(self.metadata.tensors)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def _check_usable(self) -> None:
        if self._released:
            raise RuntimeError(
                f"the received tensors of step {self.step_id} were used after release()"
            )

    def _wait_received(self) -> None:
        if is_cuda(self._device):
            # NCCL: order the current stream after the receives (no host wait;
            # a repeated NCCL wait() is harmless).
            for work in self.work.works:
                work.wait()
        else:
            self.work.wait_blocking()

    def _materialize(self) -> dict[str, torch.Tensor]:
        with self._lock:
            self._check_usable()
            if self._tensors is not None:
                return self._tensors
            self._wait_received()
            tensors: dict[str, torch.Tensor] = {}
            for meta, buf in self._received:
                dtype = _dtype_from_name(meta.dtype)
                if buf is None:
                    tensors[meta.key] = torch.empty(meta.shape, dtype=dtype, device=self._device)
                    continue
                if meta.lane:
                    full = self._pool.acquire((math.prod(meta.shape),), dtype, self._device)
                    self._buffers.append(full)
                    _all_gather_single(full, buf, group=self._tp.device_group)
                    buf = full
                tensors[meta.key] = buf.view(meta.shape)
            self._tensors = tensors
            return tensors

    async def wait(self) -> None:
        """Wait for the receives (and gather the lane keys) without blocking
        the event loop; cancellation leaves the waiting thread running."""
        if self._tensors is not None or is_cuda(self._device):
            await anyio.lowlevel.checkpoint()
            self._materialize()
            return
        await self.work.wait(abandon_on_cancel=True)
        if any(meta.lane for meta in self.metadata.tensors):
            with anyio.CancelScope(shield=True):  # a collective: let every rank finish it
                await anyio.to_thread.run_sync(self._materialize)
        else:
            self._materialize()

    def release(self) -> None:
        """Give the buffers back to the pool; the tensors must not be used after.

        If the receives were never waited for, this waits for them first (gloo:
        blocking; the lane keys are not gathered). Raises ``RuntimeError`` when
        called twice.
        """
        with self._lock:
            if self._released:
                raise RuntimeError(
                    f"the received tensors of step {self.step_id} were released twice"
                )
            if self._tensors is None:
                self._wait_received()
            self._released = True
            self._tensors = None
            for buf in self._buffers:
                self._pool.release(buf)
            self._buffers.clear()


def recv_tensor_dict(
    *,
    pool: BufferPool,
    device: torch.device | str = "cpu",
    step_id: int | None = None,
    pp: GroupCoordinator | None = None,
    tp: GroupCoordinator | None = None,
    src: int | None = None,
    metadata_bytes: int = METADATA_BYTES,
) -> AsyncIntermediateTensors:
    """Receive one step's tensor dict from the previous stage (blocking: run it
    in a worker thread).

    Blocks until the metadata arrived, then posts the tensors' receives into
    buffers from ``pool`` on ``device`` (a CUDA device must name its index:
    ``cuda:1``) and returns without waiting for them.
    ``src`` (a global rank) defaults to ``pp.prev_rank``. With ``step_id``
    given, metadata of another step raises ``RuntimeError`` (the stages are
    out of step; nothing of that step is received).
    """
    pp = pp if pp is not None else get_pp_group()
    tp = tp if tp is not None else get_tp_group()
    _check_pp(pp)
    src = pp.prev_rank if src is None else src
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        # A worker thread's current device is device 0, whatever the rank's is.
        raise ValueError(f"recv_tensor_dict needs a CUDA device with an index, got {device!r}")

    meta_buf = pool.acquire((metadata_bytes,), torch.uint8, "cpu")
    _posted(dist.irecv(meta_buf, src=src, group=pp.cpu_group), "irecv").wait()
    try:
        meta = decode_metadata(meta_buf)
    finally:
        pool.release(meta_buf)
    if step_id is not None and meta.step_id != step_id:
        raise RuntimeError(
            f"pipeline stages out of step: expected the tensors of step {step_id} "
            f"from rank {src}, received step {meta.step_id}"
        )

    tp_size = tp.world_size
    received: list[tuple[TensorMetadata, torch.Tensor | None]] = []
    works: list[dist.Work] = []
    for entry in meta.tensors:
        dtype = _dtype_from_name(entry.dtype)
        numel = math.prod(entry.shape)
        if numel == 0:
            received.append((entry, None))
            continue
        if entry.lane and (tp_size == 1 or numel % tp_size):
            raise RuntimeError(
                f"tensor-dict key {entry.key!r} of step {meta.step_id} was sent as a lane "
                f"slice of {entry.shape}, which this stage's TP size {tp_size} cannot gather"
            )
        buf = pool.acquire((numel // tp_size if entry.lane else numel,), dtype, dev)
        received.append((entry, buf))
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            works.append(_posted(dist.irecv(buf, src=src, group=pp.device_group), "irecv"))
    return AsyncIntermediateTensors(
        metadata=meta,
        src=src,
        tp=tp,
        device=dev,
        work=PendingWork(works, device=dev),
        received=received,
        pool=pool,
    )
