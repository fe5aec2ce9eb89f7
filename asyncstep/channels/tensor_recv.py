"""The receive side of the tensor-dict channel: post a step's one receive
into a pooled packed buffer, whose layout the metadata gives, and wait for it
lazily, at first use; the tensors are views of that buffer (see
:mod:`asyncstep.channels.tensor_dict` for the protocol)."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import anyio
import anyio.lowlevel
import anyio.to_thread
import torch
import torch.distributed as dist

from asyncstep.channels.buffer_pool import BufferPool
from asyncstep.channels.parallel_state import (
    GroupCoordinator,
    all_gather_into_tensor,
    get_pp_group,
    get_tp_group,
)
from asyncstep.channels.tensor_wire import (
    METADATA_BYTES,
    TensorDictMetadata,
    TensorMetadata,
    check_pp,
    decode_metadata,
    dtype_from_name,
    pack_layout,
    packed_view,
    posted,
)
from asyncstep.datatypes import IntermediateTensors
from asyncstep.device.work import PendingWork, is_cuda


class AsyncIntermediateTensors(IntermediateTensors):
    """The tensors of one received step, waited for at first use.

    The first access to :attr:`tensors` (or ``[key]``) waits for the receives
    (gloo: blocks this thread until they completed; NCCL: makes the current
    stream wait, no host wait) and all-gathers the lane keys over the TP group
    (every TP rank of the stage must use the tensors, in the same order of
    steps). ``await wait()`` does that off the event loop. ``keys()`` and
    ``len()`` need no waiting. :meth:`release` gives the buffers back to the
    pool once the consumer is done with the tensors.

    ``received`` pairs each metadata entry with its flat view of the packed
    buffer (its lane slice for a lane entry; ``None`` for an empty tensor);
    ``buffers`` are the pool's buffers those views lie in, which
    :meth:`release` gives back (with the gathered lane tensors).
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
        buffers: list[torch.Tensor],
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
        self._buffers = list(buffers)
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
            for meta, part in self._received:
                dtype = dtype_from_name(meta.dtype)
                if part is None:
                    tensors[meta.key] = torch.empty(meta.shape, dtype=dtype, device=self._device)
                    continue
                if meta.lane:
                    full = self._pool.acquire((math.prod(meta.shape),), dtype, self._device)
                    self._buffers.append(full)
                    all_gather_into_tensor(full, part, group=self._tp.device_group)
                    part = full
                tensors[meta.key] = part.view(meta.shape)
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

    Blocks until the metadata arrived, then posts the tensors' one receive
    into a packed buffer from ``pool`` on ``device`` (a CUDA device must name
    its index: ``cuda:1``) and returns without waiting for it.
    ``src`` (a global rank) defaults to ``pp.prev_rank``. With ``step_id``
    given, metadata of another step raises ``RuntimeError`` (the stages are
    out of step; nothing of that step is received).
    """
    pp = pp if pp is not None else get_pp_group()
    tp = tp if tp is not None else get_tp_group()
    check_pp(pp)
    src = pp.prev_rank if src is None else src
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        # A worker thread's current device is device 0, whatever the rank's is.
        raise ValueError(f"recv_tensor_dict needs a CUDA device with an index, got {device!r}")

    meta_buf = pool.acquire((metadata_bytes,), torch.uint8, "cpu")
    posted(dist.irecv(meta_buf, src=src, group=pp.cpu_group), "irecv").wait()
    try:
        meta = decode_metadata(meta_buf)
    finally:
        pool.release(meta_buf)
    if step_id is not None and meta.step_id != step_id:
        raise RuntimeError(
            f"pipeline stages out of step: expected the tensors of step {step_id} "
            f"from rank {src}, received step {meta.step_id}"
        )

    layout, total = pack_layout(meta, tp.world_size)
    packed = pool.acquire((total,), torch.uint8, dev) if total else None
    received: list[tuple[TensorMetadata, torch.Tensor | None]] = [
        (
            entry,
            packed_view(packed, where, dtype_from_name(entry.dtype))
            if where.nbytes and packed is not None
            else None,
        )
        for entry, where in zip(meta.tensors, layout, strict=True)
    ]
    works: list[dist.Work] = []
    if packed is not None:
        try:
            with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
                works.append(posted(dist.irecv(packed, src=src, group=pp.device_group), "irecv"))
        except BaseException:
            pool.release(packed)  # nothing was posted into it
            raise
    return AsyncIntermediateTensors(
        metadata=meta,
        src=src,
        tp=tp,
        device=dev,
        work=PendingWork(works, device=dev),
        received=received,
        buffers=[packed] if packed is not None else [],
        pool=pool,
    )
