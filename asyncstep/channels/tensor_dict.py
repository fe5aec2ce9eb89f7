"""The pipeline-parallel tensor-dict channel: vLLM's ``send_tensor_dict`` /
``recv_tensor_dict`` and ``GPUWorker``'s PP transfer, on asyncstep's types.

Wire protocol, per step, from stage ``i`` TP rank ``j`` to stage ``i + 1``
TP rank ``j`` (the PP group's ``next_rank``: one "lane" per TP rank):

1. Metadata, over the PP group's gloo **CPU group**: a msgpack-encoded
   :class:`TensorDictMetadata` in a fixed-size uint8 tensor (4-byte
   little-endian length, then the payload; :data:`METADATA_BYTES` by default,
   the same on both stages). No pickle.
2. The tensors, over the PP group's **device group** (gloo on CPU, NCCL on
   CUDA), packed into ONE uint8 buffer that travels with one ``isend`` /
   ``irecv`` (none when every tensor is empty): a hop pays one device
   operation per direction whatever the number of keys (each one's host time
   in torch's wrappers is paid per operation, not per byte). The layout
   is :func:`~asyncstep.channels.tensor_wire.pack_layout`, a pure function
   of the metadata (and the stage's TP size) that both sides compute, so it
   never travels: the entries in metadata order, each one's bytes (its lane
   slice for a lane entry) at the next multiple of
   :data:`~asyncstep.channels.tensor_wire.PACK_ALIGNMENT` (256) bytes, so a
   view of a part as any dtype is aligned; the entries may have different
   dtypes. Empty tensors take no bytes: they travel in the metadata only.
   The receiver's tensors are views of its packed buffer.

Lanes: for a key whose ``all_gather`` flag is true (the default) and whose
``numel`` divides by the TP size, each lane sends only its ``1/TP`` slice of the
flattened tensor and the receiver all-gathers the slices (views of its packed
buffer) into a full tensor over its TP group, one ``all_gather`` per such key
(metadata ``lane=True``). Keys flagged false (already sequence-parallel
scattered: every TP rank holds a different shard) and tensors that do not
divide are sent whole, lane to lane, and not gathered.

Buffer ownership. The sender copies every (slice of a) tensor into its pooled
packed buffer, so the caller's tensors may be reused as soon as
:func:`send_tensor_dict` returns; the buffers (the metadata message's and the
packed one) go back to the pool only once both sends completed
(:meth:`PendingSend.wait`, or :func:`drain` when shutting down). The receiver
posts its receive into a pooled packed buffer and waits for it lazily, at
first use (:class:`AsyncIntermediateTensors`); the consumer gives the packed
buffer (and the gathered lane tensors) back with
:meth:`AsyncIntermediateTensors.release`.

This module holds the send side and is the channel's public face; the wire
format is in :mod:`~asyncstep.channels.tensor_wire`, the receive side in
:mod:`~asyncstep.channels.tensor_recv`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
import torch.distributed as dist

from asyncstep.channels.buffer_pool import BufferPool
from asyncstep.channels.parallel_state import GroupCoordinator, get_pp_group, get_tp_group
from asyncstep.channels.tensor_recv import AsyncIntermediateTensors, recv_tensor_dict
from asyncstep.channels.tensor_wire import (
    METADATA_BYTES,
    PACK_ALIGNMENT,
    PackedPart,
    TensorDictMetadata,
    TensorMetadata,
    check_pp,
    decode_metadata,
    dtype_name,
    encode_metadata,
    pack_layout,
    packed_view,
    posted,
    warm_up,
)
from asyncstep.datatypes import IntermediateTensors
from asyncstep.device.work import PendingWork
from asyncstep.logging import get_logger

__all__ = [
    "METADATA_BYTES",
    "PACK_ALIGNMENT",
    "AsyncIntermediateTensors",
    "PackedPart",
    "PendingSend",
    "TensorDictMetadata",
    "TensorMetadata",
    "decode_metadata",
    "drain",
    "encode_metadata",
    "pack_layout",
    "recv_tensor_dict",
    "send_tensor_dict",
    "warm_up",
]

log = get_logger("channels.tensor_dict")

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
    """The in-flight sends of one step (the metadata's over gloo, then the
    packed tensors' over the device group, when any is non-empty): their
    handles and staging buffers.

    The buffers go back to the pool only once every handle completed
    (:meth:`wait`); until then they stay out of the pool, whatever happens.
    Keep the object until it is :attr:`done`: a gloo send whose handle is
    garbage-collected before it completed is cancelled, and the receiver then
    waits forever. :func:`drain` keeps the sends it gives up on.
    """

    def __init__(
        self,
        *,
        step_id: int,
        dst: int,
        work: PendingWork,
        buffers: Iterable[torch.Tensor],
        pool: BufferPool,
        device_works: Iterable[dist.Work] = (),
    ) -> None:
        self.step_id = step_id
        self.dst = dst
        self.work = work
        self._device_works = tuple(device_works)
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

    def order_current_stream(self) -> None:
        """Make the current CUDA stream wait for this step's device (NCCL)
        sends, as vLLM's ``_pp_send_work`` wait does: NCCL's ``wait()`` only
        orders the stream, the host never blocks. No-op for CPU sends."""
        for work in self._device_works:
            work.wait()

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The staging buffers (the metadata message, then the packed tensors
        when any is non-empty); do not release them yourself."""
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
    may split (see the module docstring). The tensors are copied into one
    packed buffer from ``pool`` (on the tensors' device, which they must
    share; a CUDA copy runs on the current stream, which the NCCL send waits
    for), so the caller may reuse them as soon as this returns. Await
    :meth:`PendingSend.wait` to give the buffers back. Raises ``ValueError``
    (before sending anything) when the metadata does not fit
    ``metadata_bytes`` or the non-empty tensors are on several devices.
    """
    pp = pp if pp is not None else get_pp_group()
    tp = tp if tp is not None else get_tp_group()
    check_pp(pp)
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
        metas.append(TensorMetadata(key, dtype_name(tensor.dtype), list(tensor.shape), lane))
        flat = tensor.reshape(-1)
        if lane:
            n = numel // tp_size
            flat = flat.narrow(0, tp_rank * n, n)
        parts.append(flat)
    meta = TensorDictMetadata(step_id=step_id, tensors=metas)
    # Check before taking buffers: metadata too large leaves nothing behind.
    encode_metadata(meta, size=metadata_bytes)
    layout, total = pack_layout(meta, tp_size)
    device = _one_device(items, parts)

    buffers: list[torch.Tensor] = []
    works: list[dist.Work] = []
    try:
        meta_buf = pool.acquire((metadata_bytes,), torch.uint8, "cpu")
        buffers.append(meta_buf)
        encode_metadata(meta, meta_buf)
        if total:
            packed = pool.acquire((total,), torch.uint8, device)
            buffers.append(packed)
            for part, where in zip(parts, layout, strict=True):
                if where.nbytes:
                    packed_view(packed, where, part.dtype).copy_(part)
        works.append(posted(dist.isend(meta_buf, dst=dst, group=pp.cpu_group), "isend"))
        if total:
            works.append(posted(dist.isend(packed, dst=dst, group=pp.device_group), "isend"))
    except BaseException:
        # A send already posted may still read its buffer: keep that out of
        # the pool, and its handle alive (see _keep_alive).
        for buf in buffers[len(works) :]:
            pool.release(buf)
        if works:
            partial = PendingSend(
                step_id=step_id,
                dst=dst,
                work=PendingWork(works),
                buffers=buffers[: len(works)],
                pool=pool,
            )
            _keep_alive(partial)
            log.warning("pp_send_failed_midway", step=step_id, posted=len(works))
        raise
    cuda = device if device.type == "cuda" and total else None
    return PendingSend(
        step_id=step_id,
        dst=dst,
        work=PendingWork(works, device=cuda),
        buffers=buffers,
        pool=pool,
        device_works=works[1:] if cuda is not None else (),
    )


def _one_device(items: Mapping[str, torch.Tensor], parts: list[torch.Tensor]) -> torch.device:
    """The device of the non-empty tensors (CPU when there are none): they
    share one packed buffer, so one device. ``ValueError`` otherwise."""
    devices = {part.device for part in parts if part.numel()}
    if len(devices) > 1:
        where = {key: str(t.device) for key, t in items.items() if t.numel()}
        raise ValueError(f"send_tensor_dict: the tensors are on several devices: {where}")
    return devices.pop() if devices else torch.device("cpu")


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
