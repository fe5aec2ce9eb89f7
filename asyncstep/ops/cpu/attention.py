"""The CPU attention backend's kernel (in ``cpu_kernels.c``, loaded by
:func:`~asyncstep.ops.cpu.library.load_cpu_kernels`): its
arguments and the call.

One call per layer and step stores the step's keys and values in the paged
cache and attends every request (decodes and prompt chunks) over its blocks
in place: no gather, no per-request Python. A layer's attention sinks
(gpt-oss) join each head's softmax inside the same call. Without the
library the runner keeps the torch reference backend.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["CPU_ATTENTION_DTYPES", "CpuPagedAttention", "CpuStepArgs"]

#: Query rows (query tokens x the query heads of one KV head) a work item
#: attends together: each key and value read serves that many rows.
TILE_ROWS = 24
CPU_ATTENTION_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_ARGTYPES: list[type[ctypes._SimpleCData[Any]]] = [
    _INT,  # dtype
    _PTR, _I64,  # out, out row stride
    _PTR, _I64,  # q, row stride
    _PTR, _I64,  # k, row stride
    _PTR, _I64,  # v, row stride
    _PTR, _INT,  # slot_mapping, tokens to store
    _PTR, _I64, _INT,  # kv_cache, num_blocks, block_size
    _PTR, _PTR, _INT,  # query_start_loc, seq_lens, num_reqs
    _PTR, _I64,  # block_table, row stride
    _INT, _INT, _INT,  # num_heads, num_kv_heads, head_dim
    ctypes.c_float,  # scale
    _PTR, _PTR,  # positions, rotary cos_sin cache (NULL: no rotary)
    _INT,  # sliding window (0: none)
    _PTR,  # sinks: float32 [num_heads] (NULL: none)
    _INT, _INT,  # query tokens per tile, threads
]  # fmt: skip


@dataclass(frozen=True)
class CpuStepArgs:
    """A step's attention metadata as the kernel reads it (shared by every
    layer of the step): int32 ``query_start_loc``, ``seq_lens`` and block
    table rows, int64 slots and positions (0: none given), each contiguous;
    ``tensors`` keeps them alive."""

    tensors: tuple[torch.Tensor, ...]
    num_tokens: int
    num_reqs: int
    slot_mapping: int
    query_start_loc: int
    seq_lens: int
    block_table: int
    block_table_stride: int
    positions: int

    @classmethod
    def build(
        cls,
        num_tokens: int,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> CpuStepArgs:
        """From the step's CPU metadata tensors (converted where their dtype
        or layout differs); ``positions`` only for a fused rotary."""
        qsl = query_start_loc.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        table = block_table.to(torch.int32)
        if table.dim() != 2 or table.stride(1) != 1:
            table = table.reshape(len(lens), -1).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        pos = None if positions is None else positions.to(torch.int64).contiguous()
        if len(slots) < num_tokens or len(qsl) != len(lens) + 1:
            raise ValueError("slot_mapping / query_start_loc do not match the step")
        if pos is not None and len(pos) < num_tokens:
            raise ValueError("fewer positions than tokens")
        return cls(
            tensors=tuple(t for t in (qsl, lens, table, slots, pos) if t is not None),
            num_tokens=num_tokens,
            num_reqs=len(lens),
            slot_mapping=slots.data_ptr(),
            query_start_loc=qsl.data_ptr(),
            seq_lens=lens.data_ptr(),
            block_table=table.data_ptr(),
            block_table_stride=table.stride(0),
            positions=0 if pos is None else pos.data_ptr(),
        )


class CpuPagedAttention:
    """The loaded kernel."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = library.asyncstep_cpu_paged_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = _INT

    def __call__(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        step: CpuStepArgs,
        scale: float,
        cos_sin_cache: torch.Tensor | None = None,
        num_threads: int | None = None,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Store ``k``/``v`` (the step's first ``step.num_tokens`` rows; None:
        already stored) at their slots, then write every query row's attention
        to ``out``. q/out: ``[tokens, heads * head_dim]``, k/v: ``[tokens,
        kv_heads * head_dim]``, each with unit stride in its last dimension;
        ``kv_cache``: ``[2, kv_heads, blocks, block_size, head_dim]``,
        contiguous, of q's dtype. Rows of ``out`` past the step's query
        tokens are not written. With ``cos_sin_cache`` (a rotary's, float32
        ``[max_position, head_dim]``) q and k come unrotated and are rotated
        at the step's positions (``step`` built with them); q/k are not
        modified. ``num_threads``: default torch's. ``sliding_window`` ``W``:
        a query at position ``p`` sees keys ``p - W + 1 .. p`` only.
        ``sinks``: a logit per query head ``[num_heads]`` (any float dtype;
        read as float32) that joins each row's softmax denominator without
        a value."""
        _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
        dtype = CPU_ATTENTION_DTYPES[kv_cache.dtype]
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be contiguous")
        _check_rows(out, kv_cache.dtype)
        _check_rows(q, kv_cache.dtype)
        num_heads = q.shape[1] // head_dim
        group = num_heads // num_kv_heads
        k_ptr = v_ptr = k_stride = v_stride = 0
        if k is not None and v is not None:
            _check_rows(k, kv_cache.dtype)
            _check_rows(v, kv_cache.dtype)
            k_ptr, k_stride, v_ptr, v_stride = k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0)
        sink_logits = None if sinks is None else _sink_logits(sinks, num_heads)
        cos_sin = 0
        if cos_sin_cache is not None:
            _check_rotary(cos_sin_cache, head_dim, step)
            cos_sin = cos_sin_cache.data_ptr()
        status = self._fn(
            dtype,
            out.data_ptr(),
            out.stride(0),
            q.data_ptr(),
            q.stride(0),
            k_ptr,
            k_stride,
            v_ptr,
            v_stride,
            step.slot_mapping,
            step.num_tokens,
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            step.query_start_loc,
            step.seq_lens,
            step.num_reqs,
            step.block_table,
            step.block_table_stride,
            num_heads,
            num_kv_heads,
            head_dim,
            scale,
            step.positions if cos_sin else 0,
            cos_sin,
            sliding_window or 0,
            0 if sink_logits is None else sink_logits.data_ptr(),
            max(1, TILE_ROWS // group),
            num_threads or torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("cpu paged attention: no memory for the tile plan")


def _check_rows(x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu" or x.dtype != dtype:
        raise ValueError(f"expected [tokens, heads * head_dim] rows of {dtype} on the CPU")


def _sink_logits(sinks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``sinks`` as the kernel reads them: contiguous float32 on the CPU
    (the tensor itself where it is already so)."""
    if sinks.shape != (num_heads,) or sinks.device.type != "cpu" or not sinks.is_floating_point():
        raise ValueError(f"expected {num_heads} floating-point sink logits on the CPU")
    return sinks.detach().to(torch.float32).contiguous()


def _check_rotary(cos_sin_cache: torch.Tensor, head_dim: int, step: CpuStepArgs) -> None:
    shape_ok = cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == head_dim
    if not shape_ok or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        raise ValueError("the rotary cache must be contiguous float32 [max_position, head_dim]")
    if not step.positions:
        raise ValueError("a fused rotary needs the step's positions")
