"""Weights kept 4-bit on the GPU, on the model's side: which linear layers
get a packed Q4 copy (and the LM head a Q8 one), built while the checkpoint
loads, and which steps use it.

A linear layer's float32 weight that is exactly on a 4-bit grid per block of
32 input features (a GGUF's Q4_0 / Q4_1 tensor, dequantized; detected as
:mod:`~asyncstep.ops.packed` detects it for the CPU) gets, beside
its dense weight in the model's dtype, a :class:`GpuQ4Weight`
(:mod:`asyncstep.ops.triton.quant`'s layout, scales and offsets in float16
as GGUF stores them): a step of at most
:data:`~asyncstep.ops.triton.quant.GEMV_MAX_M` rows (a decode step of one
request) multiplies by it with the Q4 GEMV, reading about a third of bf16's
bytes; larger steps multiply by the dense weight (why:
``benchmarks/studies/decode_kernels/README.md``). An LM head (not tied to the input
embedding) whose weight is exactly 8-bit per block of 32 (a GGUF's Q8_0,
dequantized) gets a :class:`GpuQ8Weight` the same way.

:func:`packing_on_load` does this as the weights load: each layer's shards
gather in a float32 staging tensor, which is copied into the dense
parameter and packed once the layer has all of them, so the float32 copy of
one layer at a time is all the extra memory while loading.

:func:`round_to_q4_1` rounds a weight onto Q4_1's grid (round to nearest,
per block: offset = its minimum, scale = its range / 15, both float16), so
an unquantized checkpoint, or random weights, can run quantized
(``weight_packing="q4"``); :func:`round_to_q8_0` rounds onto Q8_0's grid
(as llama.cpp quantizes: scale = the block's largest magnitude / 127 in
float32 for the codes, stored as float16), for an LM head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from asyncstep.models.layers.embedding import ParallelLMHead
from asyncstep.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from asyncstep.ops.packed import GROUP_SIZE, PackedWeight, _int4_grid, is_int8_blocks

#: Checkpoint (HF) names of the decoder's linear weights, by suffix.
DECODER_LINEAR_SUFFIXES = (
    ".self_attn.q_proj.weight",
    ".self_attn.k_proj.weight",
    ".self_attn.v_proj.weight",
    ".self_attn.o_proj.weight",
    ".mlp.gate_proj.weight",
    ".mlp.up_proj.weight",
    ".mlp.down_proj.weight",
)


@dataclass
class GpuQ4Weight(PackedWeight):
    """A ``[out_features, in_features]`` weight kept as Q4 on the GPU:
    ``data`` is the packed codes (uint8 ``[out, in / 2]``), ``scales`` the
    float16 ``[out, in / 32, 2]`` scale and offset of each block
    (:mod:`asyncstep.ops.triton.quant`'s layout). Steps of at most
    ``max_tokens`` rows on its device use it."""

    KIND: ClassVar[str] = "q4_gpu"
    #: The rows of two stacked halves interleaved (:meth:`interleave_halves`).
    interleaved: bool = False

    def applies(self, x: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        return rows <= self.max_tokens and x.device == self.data.device

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, in_features]``, in ``x``'s dtype."""
        from asyncstep.ops.triton.quant import q4_matmul

        out = q4_matmul(x, self.data, self.scales)
        if self.interleaved:  # back to the halves stacked
            half = out.shape[-1] // 2
            out = out.unflatten(-1, (half, 2)).transpose(-1, -2).reshape(out.shape)
        return out

    def interleave_halves(self) -> None:
        """Reorder the packed rows (once) so that rows ``2 j, 2 j + 1`` are
        the two stacked halves' rows ``j`` (a ``gate_up_proj``'s gate and up:
        what :func:`~asyncstep.ops.triton.quant.q4_gemv_fused`'s
        ``silu_pairs`` reads); :meth:`mm` still returns the halves stacked."""
        from asyncstep.ops.triton.quant import interleave_pairs

        if not self.interleaved:
            self.data, self.scales = interleave_pairs(self.data, self.scales)
            self.interleaved = True


@dataclass
class GpuQ8Weight(GpuQ4Weight):
    """:class:`GpuQ4Weight` for 8-bit codes: ``data`` is uint8 ``[out, in]``
    (:func:`asyncstep.ops.triton.quant.pack_q8`'s layout)."""

    KIND: ClassVar[str] = "q8_gpu"

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` for ``x`` ``[rows, in_features]``, in ``x``'s dtype."""
        from asyncstep.ops.triton.quant import q8_matmul

        return q8_matmul(x, self.data, self.scales)


def pack_q8_gpu(weight: torch.Tensor, max_tokens: int | None = None) -> GpuQ8Weight | None:
    """``weight`` (float32 ``[out, in]``, on its device) as :class:`GpuQ8Weight`
    for steps of at most ``max_tokens`` rows (default
    :data:`~asyncstep.ops.triton.quant.GEMV_MAX_M`), or None when it is not
    exactly 8-bit per block of 32 with float16 scales
    (:func:`~asyncstep.ops.packed.is_int8_blocks`)."""
    from asyncstep.ops.triton.quant import GEMV_MAX_M, pack_q8

    out_features, in_features = weight.shape
    if weight.numel() == 0 or not is_int8_blocks(weight):
        return None
    blocks = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    scale = blocks.abs().amax(dim=-1) / 127
    half = scale.half()
    if not bool(torch.isfinite(half).all()) or not torch.equal(half.float(), scale):
        return None
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(blocks / safe.unsqueeze(-1)).to(torch.int64)
    qweight, scales = pack_q8(codes.reshape(out_features, in_features), half)
    return GpuQ8Weight(
        GpuQ8Weight.KIND,
        qweight,
        scales,
        out_features,
        in_features,
        max_tokens=GEMV_MAX_M if max_tokens is None else max_tokens,
    )


def pack_q4_gpu(weight: torch.Tensor, max_tokens: int | None = None) -> GpuQ4Weight | None:
    """``weight`` (float32 ``[out, in]``, on its device) as :class:`GpuQ4Weight`
    for steps of at most ``max_tokens`` rows (default
    :data:`~asyncstep.ops.triton.quant.GEMV_MAX_M`), or None when it is not
    exactly 4-bit per block of 32, or a block's scale or offset overflows
    float16."""
    from asyncstep.ops.triton.quant import GEMV_MAX_M, pack_q4

    out_features, in_features = weight.shape
    if weight.dtype != torch.float32 or in_features % GROUP_SIZE or weight.numel() == 0:
        return None
    found = _int4_grid(weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE))
    if found is None:
        return None
    codes, scale, zero = found
    offset = zero - 8 * scale  # w = (q - 8) * scale + zero = q * scale + offset
    qweight, scales = pack_q4(codes.reshape(out_features, in_features), scale, offset)
    if not bool(torch.isfinite(scales).all()):
        return None
    return GpuQ4Weight(
        GpuQ4Weight.KIND,
        qweight,
        scales,
        out_features,
        in_features,
        max_tokens=GEMV_MAX_M if max_tokens is None else max_tokens,
    )


def round_to_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[..., K]``, K a multiple of 32) rounded onto Q4_1's grid
    per block of 32 (see the module's docstring), in float32."""
    w = weight.float()
    blocks = w.reshape(-1, GROUP_SIZE)
    lo = blocks.amin(dim=-1, keepdim=True).half().float()
    scale = ((blocks.amax(dim=-1, keepdim=True) - lo) / 15).half().float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((blocks - lo) / safe).clamp_(0, 15)
    return (codes * scale + lo).reshape(w.shape)


def round_to_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[..., K]``, K a multiple of 32) rounded onto Q8_0's grid
    per block of 32 (see the module's docstring), in float32."""
    w = weight.float()
    blocks = w.reshape(-1, GROUP_SIZE)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(blocks / safe).clamp_(-127, 127)
    return (codes * scale.half().float()).reshape(w.shape)


def round_decoder_weights(
    weights: Iterable[tuple[str, torch.Tensor]], lm_head: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, the decoder's linear weights rounded with
    :func:`round_to_q4_1`, and with ``lm_head`` the LM head's with
    :func:`round_to_q8_0` (the embeddings, and else the LM head, as they are)."""
    for name, tensor in weights:
        if tensor.shape[-1] % GROUP_SIZE == 0:
            if name.endswith(DECODER_LINEAR_SUFFIXES):
                tensor = round_to_q4_1(tensor)
            elif lm_head and name == "lm_head.weight":
                tensor = round_to_q8_0(tensor)
        yield name, tensor


class _Stager:
    """Stands in for a layer's weight loader: gathers its shards in float32,
    then copies the whole weight into the dense parameter and packs it."""

    def __init__(
        self,
        module: ColumnParallelLinear | RowParallelLinear | ParallelLMHead,
        param: nn.Parameter,
        loader: Callable[..., None],
        parts: int,
        counts: dict[str, int],
    ) -> None:
        self.module = module
        self.param = param
        self.loader = loader
        self.left = parts
        self.counts = counts
        self.staging: torch.Tensor | None = None

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        if self.staging is None:
            self.staging = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        self.loader(self.staging, loaded, *shard)
        self.left -= 1
        if self.left == 0:
            self._finish()

    def _finish(self) -> None:
        assert self.staging is not None
        self.param.data.copy_(self.staging)
        packed = pack_q4_gpu(self.staging)
        if packed is None and isinstance(self.module, ParallelLMHead):
            packed = pack_q8_gpu(self.staging)
        if packed is None:
            self.counts["dense"] += 1
        else:
            self.module.packed = packed
            self.counts["q8" if isinstance(packed, GpuQ8Weight) else "q4"] += 1
            self.counts["bytes"] += packed.nbytes
        self.staging = None


def _parts(module: nn.Module) -> int:
    """How many checkpoint tensors make up the layer's weight."""
    if isinstance(module, QKVParallelLinear):
        return 3
    if isinstance(module, MergedColumnParallelLinear):
        return len(module.output_sizes)
    return 1


@contextmanager
def packing_on_load(model: nn.Module, tied: nn.Parameter | None = None) -> Iterator[dict[str, int]]:
    """While open, loading ``model``'s weights gives every linear layer (and
    an LM head whose weight is not ``tied``, the input embedding's) whose
    weight is exactly 4-bit a packed copy, and such an LM head whose weight
    is exactly 8-bit a Q8 one (see the module's docstring). Yields the
    counts, filled as layers complete: ``q4``, ``q8``, ``dense`` (no copy)
    and the packed ``bytes``."""
    counts = {"q4": 0, "q8": 0, "dense": 0, "bytes": 0}
    wrapped: list[tuple[nn.Parameter, Callable[..., None]]] = []
    for module in model.modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear | ParallelLMHead):
            continue
        if isinstance(module, ParallelLMHead) and module.weight is tied:
            continue
        param = module.weight
        loader = param.weight_loader  # type: ignore[attr-defined]
        wrapped.append((param, loader))
        param.weight_loader = _Stager(  # type: ignore[attr-defined]
            module, param, loader, _parts(module), counts
        )
    try:
        yield counts
    finally:
        for param, loader in wrapped:
            param.weight_loader = loader  # type: ignore[attr-defined]
