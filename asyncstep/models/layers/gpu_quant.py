"""Weights kept 4-bit on the GPU, on the model's side: which linear layers
get a packed Q4 copy (and the LM head a Q8 one), built while the checkpoint
loads.

A linear layer's float32 weight that is exactly on a 4-bit grid per block of
32 input features (a GGUF's Q4_0 / Q4_1 tensor, dequantized; detected as
:mod:`~asyncstep.ops.packed` detects it for the CPU) gets, beside
its dense weight in the model's dtype, a packed Q4 copy
(:func:`asyncstep.ops.weights.pack_gpu`; the format and its GEMV are the
Triton op set's): a step of one row (a decode step of one request)
multiplies by it, reading about a third of bf16's bytes; larger steps
multiply by the dense weight (why: ``benchmarks/studies/decode_kernels/README.md``). An
LM head (not tied to the input embedding) whose weight is exactly 8-bit per
block of 32 (a GGUF's Q8_0, dequantized) gets a Q8 copy the same way.

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

import torch
from torch import nn

from asyncstep.models.layers.embedding import ParallelLMHead
from asyncstep.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from asyncstep.ops.packed import GROUP_SIZE
from asyncstep.ops.weights import GPU_Q8_KIND, pack_gpu

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
        packed = pack_gpu(self.staging, lm_head=isinstance(self.module, ParallelLMHead))
        if packed is None:
            self.counts["dense"] += 1
        else:
            self.module.packed = packed
            self.counts["q8" if packed.kind == GPU_Q8_KIND else "q4"] += 1
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
