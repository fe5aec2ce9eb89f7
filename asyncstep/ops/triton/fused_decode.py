"""The fused decode: a decoder layer's step of a few tokens (a batch-1
decode) as four GEMVs over its packed 4-bit weights, the elementwise
kernels folded into them (issue 28):

- ``o_proj``: the residual add in its epilogue (it returns the new
  residual stream), and the post-attention RMSNorm's per-element part: the
  stream times the norm's weight (float32) and the sums of its squares over
  each program's features;
- ``gate_up_proj``: that norm in its prologue (one scale a row, from the
  sums, on its dot products), SiLU·mul in its epilogue (its rows are
  stored gate and up interleaved, so that a program holds both of a pair);
- ``down_proj``: the residual add in its epilogue, and the next layer's
  input RMSNorm's part as o's;
- ``qkv_proj``: that norm in its prologue (the first layer's: its own
  sums, over the embedding's output).

So a layer is qkv, the rotary + KV store, the attention (two kernels) and
three GEMVs: seven kernels against ten unfused. The layers pass the
residual stream (``hidden + residual`` of the unfused layer) alone. The
result equals the unfused layer's but for the rounding of the normed rows
(kept in float32 here, rounded to the activations' dtype there); the
residual adds and SiLU·mul round as the unfused kernels do.

Tried first and slower (``benchmarks/studies/decode_kernels/README.md``): both norms
and SiLU·mul in the prologues of the GEMV that reads them, each program
redoing the per-element work over the whole row.

It applies where every linear layer of the layer holds a
:class:`~asyncstep.ops.triton.quant_weight.GpuQ4Weight` for the step's
size, without bias, with one tensor-parallel rank (the row-parallel layers'
epilogue would add the residual to a partial sum). :class:`FusedDecodePath`
is the Triton op set's step path over a stage's layers
(:meth:`~asyncstep.ops.triton.ops.TritonOps.step_path`, with
``fused_decode``); it reads the layers by their attributes (ops import no
model): the norms' ``weight`` and ``eps``, ``self_attn.split_qkv`` and
``self_attn.attn``, and each projection's ``packed``, ``bias`` and
``tp_size``.

Kernels: :func:`asyncstep.ops.triton.quant.q4_gemv_fused`.

May import torch, triton (on use), :mod:`asyncstep.ops`' attention metadata
and the Triton quantized formats and kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from asyncstep.ops.attention import AttentionMetadata
from asyncstep.ops.triton.quant_weight import GpuQ4Weight, GpuQ8Weight

if TYPE_CHECKING:  # triton is imported on use
    from asyncstep.ops.triton.quant import NormedRows

__all__ = ["FusedDecodePath", "FusedDecodeWeights", "fused_gemv"]

#: A model's decoder layer, its norm or its linear layer, read by their
#: attributes (the module's docstring).
DecoderLayer = Any


@dataclass(frozen=True)
class FusedDecodeWeights:
    """A decoder layer's four packed weights, as the fused decode takes them."""

    qkv: GpuQ4Weight
    o: GpuQ4Weight
    gate_up: GpuQ4Weight
    down: GpuQ4Weight

    @classmethod
    def of(
        cls,
        qkv: DecoderLayer,
        o: DecoderLayer,
        gate_up: DecoderLayer,
        down: DecoderLayer,
    ) -> FusedDecodeWeights | None:
        """The layers' packed weights, or None where one of them has none
        (or an 8-bit one), has a bias or is split over tensor-parallel ranks."""
        packed = []
        for layer in (qkv, o, gate_up, down):
            weight = layer.packed
            if not isinstance(weight, GpuQ4Weight) or isinstance(weight, GpuQ8Weight):
                return None
            if layer.tp_size != 1 or getattr(layer, "bias", None) is not None:
                return None
            packed.append(weight)
        return cls(*packed)

    def applies(self, x: torch.Tensor) -> bool:
        """Whether a step of rows ``x`` takes the packed weights (its size and device)."""
        return all(w.applies(x) for w in (self.qkv, self.o, self.gate_up, self.down))

    def prepare(self) -> None:
        """Store gate_up's rows interleaved (once), as its SiLU·mul epilogue reads them."""
        self.gate_up.interleave_halves()


def fused_gemv(
    weight: GpuQ4Weight, x: torch.Tensor, **fused: Any
) -> tuple[torch.Tensor, NormedRows | None]:
    """:func:`~asyncstep.ops.triton.quant.q4_gemv_fused` of ``weight``
    (``fused``: its keywords, ``int8_x`` included)."""
    from asyncstep.ops.triton.quant import q4_gemv_fused

    return q4_gemv_fused(x, weight.data, weight.scales, **fused)


def fused_decode_layer(
    layer: DecoderLayer,
    cos_sin: Any,
    stream: torch.Tensor,
    normed: NormedRows | None,
    meta: AttentionMetadata,
    weights: FusedDecodeWeights,
    next_norm: DecoderLayer | None,
    int8_x: bool = False,
) -> tuple[torch.Tensor, NormedRows | None]:
    """``layer`` on the residual stream (``hidden + residual`` of its
    unfused forward) in four GEMVs: ``normed``: the stream made ready for
    the input norm by the previous layer (None: the norm is done over the
    stream here). Returns the new stream, and with ``next_norm`` (the next
    layer's input norm) its rows made ready for it. ``int8_x``: the GEMVs
    quantize a 16-bit x per block to int8."""
    attn, ln, post_ln = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    if normed is None:
        qkv, _ = fused_gemv(
            weights.qkv, stream, rms_norm_weight=ln.weight, eps=ln.eps, int8_x=int8_x
        )
    else:
        qkv, _ = fused_gemv(
            weights.qkv,
            normed.xw,
            sq_parts=normed.sq_parts,
            eps=ln.eps,
            out_dtype=stream.dtype,
            int8_x=int8_x,
        )
    q, k, v = attn.split_qkv(cos_sin, qkv)
    stream, normed = fused_gemv(
        weights.o,
        attn.attn(q, k, v, meta),
        residual=stream,
        next_rms_norm_weight=post_ln.weight,
        int8_x=int8_x,
    )
    assert normed is not None
    activated, _ = fused_gemv(
        weights.gate_up,
        normed.xw,
        sq_parts=normed.sq_parts,
        eps=post_ln.eps,
        silu_pairs=True,
        out_dtype=stream.dtype,
        int8_x=int8_x,
    )
    return fused_gemv(
        weights.down,
        activated,
        residual=stream,
        next_rms_norm_weight=None if next_norm is None else next_norm.weight,
        int8_x=int8_x,
    )


class FusedDecodePath:
    """A stage's layers as the fused decode, for the steps every layer's
    packed weights take (a :class:`~asyncstep.ops.base.StepPath`)."""

    def __init__(
        self,
        layers: list[DecoderLayer],
        weights: list[FusedDecodeWeights],
        *,
        int8_x: bool = False,
    ) -> None:
        self.layers = layers
        self.weights = weights
        #: The GEMVs quantize a 16-bit x per block to int8 (opt-in).
        self.int8_x = int8_x

    @classmethod
    def build(cls, layers: list[DecoderLayer], *, int8_x: bool = False) -> FusedDecodePath | None:
        """The path over ``layers`` where each takes it (every projection
        packed as Q4, no bias, one TP rank), its gate_up rows interleaved
        once (outside any CUDA graph capture); else None. ``int8_x``: the
        GEMVs' activations (:func:`fused_decode_layer`)."""
        found = [_layer_weights(layer) for layer in layers]
        weights = [w for w in found if w is not None]
        if not layers or len(weights) != len(found):
            return None
        for w in weights:
            w.prepare()
        return cls(layers, weights, int8_x=int8_x)

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        return all(w.applies(hidden) for w in self.weights)

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream after the stage's layers, and no residual
        (each layer's adds are in its GEMVs)."""
        layers = self.layers
        cos_sin = layers[0].self_attn.rotary[0].cos_sin(positions, hidden.dtype)
        stream = hidden if residual is None else hidden + residual
        normed = None
        for i, (layer, weights) in enumerate(zip(layers, self.weights, strict=True)):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            stream, normed = fused_decode_layer(
                layer, cos_sin, stream, normed, meta, weights, next_norm, self.int8_x
            )
        return stream, None


def _layer_weights(layer: DecoderLayer) -> FusedDecodeWeights | None:
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(mlp, "gate_up_proj", None) is None:
        return None  # a mixture-of-experts layer
    return FusedDecodeWeights.of(attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
