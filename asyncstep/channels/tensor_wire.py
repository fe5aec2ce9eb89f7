"""The tensor-dict channel's wire format and link helpers: the metadata
message (msgspec/msgpack in a fixed-size uint8 tensor, never pickle) that
precedes each step's tensors, the layout of the one packed buffer that carries
them (:func:`pack_layout`, a pure function of the metadata both stages share),
and the warm-up of a stage's PP links.
See :mod:`asyncstep.channels.tensor_dict` for the protocol."""

from __future__ import annotations

import math
from typing import NamedTuple

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from asyncstep.channels.parallel_state import GroupCoordinator, get_pp_group

METADATA_BYTES = 4096
_LENGTH_BYTES = 4
#: Every part of the packed buffer starts at a multiple of this many bytes from
#: the buffer's start (itself 64-byte aligned on CPU, 512 on CUDA: a pooled
#: buffer is a fresh allocation), so a view of a part as any dtype (itemsize at
#: most 16) is aligned, and so is what a kernel reads through it.
PACK_ALIGNMENT = 256


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"tensor-dict metadata names an unknown dtype {name!r}")
    return dtype


class PackedPart(NamedTuple):
    """Where one tensor-dict entry lies in the packed buffer, in bytes."""

    offset: int
    #: 0 for an empty tensor (it travels in the metadata only).
    nbytes: int


def sent_numel(entry: TensorMetadata, tp_size: int) -> int:
    """How many elements of ``entry`` travel: its lane slice, or all of it.

    Raises ``RuntimeError`` for a lane entry that ``tp_size`` cannot gather.
    """
    if any(d < 0 for d in entry.shape):
        raise RuntimeError(
            f"corrupt tensor-dict metadata: key {entry.key!r} has the shape {entry.shape}"
        )
    numel = math.prod(entry.shape)
    if not entry.lane:
        return numel
    if tp_size == 1 or numel % tp_size:
        raise RuntimeError(
            f"tensor-dict key {entry.key!r} was sent as a lane slice of {entry.shape}, "
            f"which a TP size of {tp_size} cannot gather"
        )
    return numel // tp_size


def pack_layout(meta: TensorDictMetadata, tp_size: int) -> tuple[list[PackedPart], int]:
    """The packed buffer of one step: one :class:`PackedPart` per entry of
    ``meta.tensors`` (in order) and the buffer's size in bytes.

    Each non-empty entry (its :func:`sent_numel` elements) starts at the first
    multiple of :data:`PACK_ALIGNMENT` after the previous one; empty entries
    take no bytes. The sender and the receiver both compute it from the
    metadata alone (``tp_size``: the TP size of the calling stage), so it never
    travels. ``RuntimeError`` on metadata naming an unknown dtype, a negative
    dimension, or a lane entry this TP size cannot gather.
    """
    parts: list[PackedPart] = []
    end = 0
    for entry in meta.tensors:
        itemsize = dtype_from_name(entry.dtype).itemsize
        assert PACK_ALIGNMENT % itemsize == 0, (entry.dtype, PACK_ALIGNMENT)
        nbytes = sent_numel(entry, tp_size) * itemsize
        if nbytes == 0:
            parts.append(PackedPart(end, 0))
            continue
        offset = -(-end // PACK_ALIGNMENT) * PACK_ALIGNMENT
        parts.append(PackedPart(offset, nbytes))
        end = offset + nbytes
    return parts, end


def packed_view(buf: torch.Tensor, part: PackedPart, dtype: torch.dtype) -> torch.Tensor:
    """``part`` of the uint8 buffer ``buf`` as a flat tensor of ``dtype`` (a view)."""
    return buf.narrow(0, part.offset, part.nbytes).view(dtype)


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


def check_pp(pp: GroupCoordinator) -> None:
    if pp.world_size < 2 or pp.device_group is None or pp.cpu_group is None:
        raise ValueError(
            "the tensor-dict channel needs a pipeline-parallel group of at least 2 ranks "
            f"(this rank's has {pp.world_size})"
        )


def posted(work: dist.Work | None, what: str) -> dist.Work:
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
    own: without a warm-up the first step pays it, and a
    first ``send_tensor_dict`` whose receiver waits on something else first
    deadlocks. One element goes down the chain of stages (stage ``i``
    receives from ``i - 1``, then sends to ``i + 1``), so no pair waits on
    another. Harmless on gloo.
    """
    pp = pp if pp is not None else get_pp_group()
    check_pp(pp)
    x = torch.zeros(1, device=device)
    if not pp.is_first_rank:
        posted(dist.irecv(x, src=pp.prev_rank, group=pp.device_group), "irecv").wait()
    if not pp.is_last_rank:
        posted(dist.isend(x, dst=pp.next_rank, group=pp.device_group), "isend").wait()
    if x.is_cuda:
        torch.cuda.current_stream(x.device).synchronize()
