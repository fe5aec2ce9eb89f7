"""A pipeline stage's decoder layers in one call of the CPU library
(``cpu_decode.c``) for every step the packed weights take (by default
every step: one path for every step's size, each row computed alone, so a
request's tokens do not depend on its batch): the layer-by-layer forward's
work (norms, quantized projections, rotary + KV store + paged attention,
silu * up) without a Python call per op.

:meth:`CpuDecodeStack.build` makes one for a model whose every projection is
kept quantized for the CPU library
(:class:`~asyncstep.ops.cpu.quant.CpuQuantWeight`) and whose
attention is the CPU kernel with its rotary fused, on one tensor-parallel
rank (the stack has no all-reduce), without per-head q/k norms (a layer's
sliding window and attention sinks go to its attention), whose every
layer has a dense gated MLP (a mixture-of-experts layer, as gpt-oss's,
declines); else None, and the model keeps
its layer-by-layer forward. Steps of more tokens than the packed weights
take (or with padding rows), and steps of a model with several KV cache
groups (``meta.kv_groups``), go layer by layer too.

It is the CPU op set's step path (:meth:`~asyncstep.ops.cpu.ops.CpuOps.step_path`).
It reads a model's decoder layers by their attributes (ops import no
model): ``input_layernorm`` / ``post_attention_layernorm`` (``weight``,
``eps``), ``self_attn`` (``qkv_proj``, ``o_proj``, ``q_norm``, ``rotary``,
``attn``: heads, scale, ``kv_cache``, ``rotates``, ``ops``, ``shape.sinks``) and ``mlp``
(``gate_up_proj``, ``down_proj``), each projection's ``packed``, ``bias``
and ``tp_size``.

May import torch and :mod:`asyncstep.ops`' attention metadata and CPU library.
"""

from __future__ import annotations

import ctypes
import struct
from typing import TYPE_CHECKING, Any

import torch

from asyncstep.ops.attention import AttentionMetadata
from asyncstep.ops.cpu.quant import _KINDS, QUANT_DTYPES, CpuQuantWeight, quant_matmul
from asyncstep.ops.cpu.stack_args import stream_and_step

if TYPE_CHECKING:
    from asyncstep.ops.cpu.library import CpuKernels

__all__ = ["CpuDecodeStack"]

#: A model's decoder layer, read by its attributes (the module's docstring).
DecoderLayer = Any

#: ``StackLayer``: input norm, qkv (kind, data, out, in), qkv bias, o, post
#: norm, gate_up, down, KV cache, its blocks, the sliding window (0: none),
#: the sinks (float32, 0: none). 8 bytes per field.
_LAYER = struct.Struct("<" + "q" * 23)
#: ``StackArgs`` (see cpu_decode.c): 8 bytes per field.
_ARGS = struct.Struct(
    "<qqq"  # dtype, layers, layer array
    "qqq"  # tokens, hidden, intermediate
    "qqqq"  # heads, kv heads, head_dim, block_size
    "dd"  # eps, scale
    "q"  # levels
    "qq"  # hidden_in, row stride
    "qq"  # residual_in (0: none), row stride
    "qq"  # hidden_out, residual_out
    "qqqq"  # slot_mapping, query_start_loc, seq_lens, num_reqs
    "qq"  # block_table, row stride
    "qq"  # positions, cos_sin cache
    "qq"  # attention tile tokens, threads
)


class CpuDecodeStack:
    """The stage's layers as the library's one call (see the module's docstring)."""

    def __init__(self, library: ctypes.CDLL, layers: list[DecoderLayer]) -> None:
        self._fn = library.asyncstep_decode_stack
        self._fn.argtypes = [ctypes.c_char_p]
        self._fn.restype = ctypes.c_int
        self.layers = layers
        #: Each layer's attention, looked up once (a module's attribute
        #: lookups are Python calls, paid per step otherwise).
        self._attns = [layer.self_attn.attn for layer in layers]
        first = layers[0]
        attn = first.self_attn.attn
        self._rotary = first.self_attn.rotary[0]
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, attn.scale
        self.hidden_size = first.self_attn.o_proj.output_size
        self.intermediate_size = first.mlp.down_proj.input_size_per_partition
        self.eps = first.input_layernorm.eps
        weights = [_quantized(layer) or () for layer in layers]
        self.max_tokens = min(w.max_tokens for ws in weights for w in ws)
        self.levels = weights[0][0].levels
        self.dtype = weights[0][0].scales.dtype
        #: qkv biases widened to float32 (the kernel adds them so).
        self._biases = [
            None if layer.self_attn.qkv_proj.bias is None else layer.self_attn.qkv_proj.bias.float()
            for layer in layers
        ]
        self._layer_array: ctypes.Array[ctypes.c_char] | None = None
        self._bound_caches: tuple[int, ...] = ()
        #: Each layer's sinks as the kernel reads them (kept alive with the array).
        self._sinks: list[torch.Tensor | None] = []

    @classmethod
    def build(cls, kernels: CpuKernels, layers: list[DecoderLayer]) -> CpuDecodeStack | None:
        """The stack for ``layers`` when they qualify (the module's docstring), else None."""
        matmul = quant_matmul()
        if not layers or matmul is None or not matmul.fast:
            return None
        for layer in layers:
            if getattr(layer.mlp, "gate_up_proj", None) is None:
                return None  # a mixture-of-experts layer: no dense gated MLP
            attention = layer.self_attn
            if attention.q_norm is not None or not attention.attn.rotates:
                return None
            if attention.attn.ops.ops.attention_op.name != "cpu" or attention.o_proj.tp_size != 1:
                return None
            if _quantized(layer) is None or attention.o_proj.bias is not None:
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.float32 for w in norms) or layer.mlp.down_proj.bias is not None:
                return None  # the stack keeps a float32 residual stream, as such norms do
        kinds = {(w.levels, w.scales.dtype) for layer in layers for w in _quantized(layer) or ()}
        if len(kinds) != 1:
            return None
        return cls(kernels.library, layers)

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step of ``hidden`` goes through the stack."""
        rows = hidden.shape[0]
        return (
            0 < rows <= self.max_tokens
            and rows == meta.num_actual_tokens
            and not meta.kv_groups
            and hidden.dtype == self.dtype
            and hidden.dim() == 2
            and hidden.stride(1) == 1
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` after the stage's layers (as the
        layer-by-layer forward returns them: the last MLP's output, and the
        float32 residual stream); the positions are ``meta``'s."""
        fields, hidden_out, residual_out = stream_and_step(
            hidden,
            residual,
            meta,
            self._rotary.cos_sin_cache,
            self.num_heads // self.num_kv_heads,
            hidden.dtype,
        )
        args = _ARGS.pack(
            QUANT_DTYPES[self.dtype],
            len(self.layers),
            ctypes.addressof(self._layers()),
            hidden.shape[0],
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self._attns[0].kv_cache.shape[3],
            self.eps,
            self.scale,
            self.levels,
            *fields,
        )
        if self._fn(args) != 0:
            raise MemoryError("the CPU decode stack found no memory for its buffers")
        return hidden_out, residual_out

    def _layers(self) -> ctypes.Array[ctypes.c_char]:
        """The layers' ``StackLayer`` array, rebuilt when the KV caches are re-bound."""
        caches = tuple(attn.kv_cache.data_ptr() for attn in self._attns)
        if self._layer_array is None or caches != self._bound_caches:
            self._sinks = [_float32_sinks(layer) for layer in self.layers]
            packed = b"".join(
                self._pack_layer(layer, bias, sinks)
                for layer, bias, sinks in zip(self.layers, self._biases, self._sinks, strict=True)
            )
            self._layer_array = ctypes.create_string_buffer(packed, len(packed))
            self._bound_caches = caches
        return self._layer_array

    @staticmethod
    def _pack_layer(
        layer: DecoderLayer, bias: torch.Tensor | None, sinks: torch.Tensor | None
    ) -> bytes:
        qkv, o, gate_up, down = _quantized(layer) or ()
        kv_cache = layer.self_attn.attn.kv_cache
        if kv_cache.dim() != 5 or not kv_cache.is_contiguous():
            raise ValueError("the decode stack needs each layer's contiguous paged KV cache")
        return _LAYER.pack(
            _contiguous_f32(layer.input_layernorm.weight),
            *_weight_fields(qkv),
            0 if bias is None else bias.data_ptr(),
            *_weight_fields(o),
            _contiguous_f32(layer.post_attention_layernorm.weight),
            *_weight_fields(gate_up),
            *_weight_fields(down),
            kv_cache.data_ptr(),
            kv_cache.shape[2],
            layer.self_attn.attn.sliding_window or 0,
            0 if sinks is None else sinks.data_ptr(),
        )


def _quantized(layer: DecoderLayer) -> tuple[CpuQuantWeight, ...] | None:
    """The layer's four projections' packed weights, when each is the CPU library's."""
    modules = (
        layer.self_attn.qkv_proj,
        layer.self_attn.o_proj,
        layer.mlp.gate_up_proj,
        layer.mlp.down_proj,
    )
    packed = tuple(m.packed for m in modules)
    if all(isinstance(p, CpuQuantWeight) for p in packed):
        return packed
    return None


def _float32_sinks(layer: DecoderLayer) -> torch.Tensor | None:
    """The layer's attention sinks as contiguous float32 (the parameter
    itself where it is so: loads in place are seen), or None."""
    sinks = layer.self_attn.attn.shape.sinks
    return None if sinks is None else sinks.detach().to(torch.float32).contiguous()


def _weight_fields(weight: CpuQuantWeight) -> tuple[int, int, int, int]:
    return _KINDS[weight.kind], weight.data.data_ptr(), weight.out_features, weight.in_features


def _contiguous_f32(weight: torch.Tensor) -> int:
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError("the decode stack needs contiguous float32 norm weights")
    return weight.data_ptr()
