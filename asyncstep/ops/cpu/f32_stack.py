"""A float32 model's decoder layers in one call of the CPU library
(``cpu_f32_stack.c``) for every step: the layer-by-layer forward's calls
of the library (norms, the float32 matmul, q/k norms, rotary + KV store +
paged attention, silu * up, the MoE router and experts) in the same order
on the same inputs, so the same bits, without a Python call between them.
A mixture-of-experts model's decode steps spend most of their host time
there (a dozen module calls, torch ops and argument packings a layer).

:meth:`CpuF32Stack.build` makes one for layers whose projections are
dense float32 weights the op set multiplies with the library's float32
matmul (``invariant_float32``; no packed copy), whose attention is the CPU
kernel with its rotary fused, on one tensor-parallel rank without sequence
parallelism, and whose feed-forward is a dense gated MLP (``gate_up_proj``,
``down_proj``; silu) or a mixture of experts (``gate``, ``experts``: float32
or MXFP4 weights, no expert parallelism); else None, and the model keeps its
layer-by-layer forward. Steps with padding rows, or of a model with several
KV cache groups (``meta.kv_groups``), go layer by layer too.

It reads a model's decoder layers by their attributes (ops import no
model): ``input_layernorm`` / ``post_attention_layernorm`` (``weight``,
``eps``), ``self_attn`` (``qkv_proj``, ``o_proj``, ``q_norm``, ``k_norm``,
``rotary``, ``attn``: heads, scale, ``kv_cache``, ``rotates``, ``ops``,
``shape.sinks``, ``sliding_window``) and ``mlp`` (``gate_up_proj`` and
``down_proj``, or ``gate``, ``top_k``, ``renormalize``, ``scoring_func``
and ``experts``: ``w13_weight``, ``w2_weight``, their MXFP4 forms and
biases, ``activation``, ``tokens_per_expert``).

May import torch and :mod:`asyncstep.ops`' attention metadata and CPU library.
"""

from __future__ import annotations

import copy
import ctypes
import struct
from typing import TYPE_CHECKING, Any

import torch

from asyncstep.ops.attention import AttentionMetadata
from asyncstep.ops.cpu.layer_ops import torch_vector_bytes
from asyncstep.ops.cpu.moe import ACTIVATION_CODES, SCORING_CODES
from asyncstep.ops.cpu.stack_args import stream_and_step
from asyncstep.ops.mxfp4 import Mxfp4Weight

if TYPE_CHECKING:
    from asyncstep.ops.cpu.library import CpuKernels

__all__ = ["CpuF32Stack"]

#: A model's decoder layer, read by its attributes (the module's docstring).
DecoderLayer = Any

#: ``F32Layer`` (cpu_f32_stack.c): 8 bytes per field.
_LAYER = struct.Struct(
    "<qqq"  # input norm, qkv, qkv bias
    "qqqq"  # q norm, k norm, their widths
    "qqq"  # o, o bias, post norm
    "q"  # intermediate size
    "qq"  # dense: gate_up, down
    "qqqqq"  # experts, top k, scoring, renormalize, activation
    "qq"  # router, its bias
    "qqqqqq"  # w13, w2, their MXFP4 scales, their biases
    "q"  # expert counts
    "qqqq"  # KV cache, its blocks, sliding window, sinks
)
#: ``F32StackArgs`` (cpu_f32_stack.c): 8 bytes per field.
_ARGS = struct.Struct(
    "<qq"  # layers, layer array
    "qq"  # tokens, hidden
    "qqqq"  # heads, kv heads, head_dim, block_size
    "dd"  # eps, scale
    "qq"  # hidden_in, row stride
    "qq"  # residual_in (0: none), row stride
    "qq"  # hidden_out, residual_out
    "qqqq"  # slot_mapping, query_start_loc, seq_lens, num_reqs
    "qq"  # block_table, row stride
    "qq"  # positions, cos_sin cache
    "qqq"  # attention tile tokens, threads, torch's vector bytes
)


class CpuF32Stack:
    """The stage's layers as the library's one call (see the module's docstring)."""

    def __init__(self, library: ctypes.CDLL, layers: list[DecoderLayer]) -> None:
        self._library = library
        self._fn = library.asyncstep_f32_stack
        self._fn.argtypes = [ctypes.c_char_p]
        self._fn.restype = ctypes.c_int
        self.layers = layers
        #: Each layer's attention and expert counts, looked up once (a
        #: module's attribute lookups are Python calls, paid per step otherwise).
        self._attns = [layer.self_attn.attn for layer in layers]
        self._counts = [_expert_counts(layer) for layer in layers]
        first = layers[0]
        attn = first.self_attn.attn
        self._rotary = first.self_attn.rotary[0]
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, attn.scale
        self.hidden_size = first.self_attn.o_proj.output_size
        self.eps = first.input_layernorm.eps
        self._vector_bytes = torch_vector_bytes()
        self._layer_array: ctypes.Array[ctypes.c_char] | None = None
        self._bound: tuple[int, ...] = ()
        #: Tensors the layer array points into (kept alive with it).
        self._kept: list[torch.Tensor] = []

    def __deepcopy__(self, memo: dict[int, object]) -> CpuF32Stack:
        """The stack over a copied model's layers (a ctypes function is not copied)."""
        return CpuF32Stack(self._library, copy.deepcopy(self.layers, memo))

    @classmethod
    def build(cls, kernels: CpuKernels, layers: list[DecoderLayer]) -> CpuF32Stack | None:
        """The stack for ``layers`` when they qualify (the module's docstring), else None."""
        if not layers or not all(_qualifies(layer) for layer in layers):
            return None
        first = layers[0].self_attn.attn
        shapes = {
            (a.num_heads, a.num_kv_heads, a.head_dim, a.scale)
            for a in (layer.self_attn.attn for layer in layers)
        }
        eps = {n.eps for layer in layers for n in _norms(layer)}
        if len(shapes) != 1 or len(eps) != 1 or first.num_heads % first.num_kv_heads:
            return None
        return cls(kernels.library, layers)

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step of ``hidden`` goes through the stack."""
        return (
            hidden.dim() == 2
            and 0 < hidden.shape[0] == meta.num_actual_tokens
            and not meta.kv_groups
            and hidden.dtype == torch.float32
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
        layer-by-layer forward returns them: the last feed-forward's output,
        and the residual stream); the positions are ``meta``'s."""
        fields, hidden_out, residual_out = stream_and_step(
            hidden,
            residual,
            meta,
            self._rotary.cos_sin_cache,
            self.num_heads // self.num_kv_heads,
            torch.float32,
        )
        args = _ARGS.pack(
            len(self.layers),
            ctypes.addressof(self._layers()),
            hidden.shape[0],
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self._attns[0].kv_cache.shape[3],
            self.eps,
            self.scale,
            *fields,
            self._vector_bytes,
        )
        if self._fn(args) != 0:
            raise MemoryError("the CPU float32 stack found no memory for its buffers")
        return hidden_out, residual_out

    def _layers(self) -> ctypes.Array[ctypes.c_char]:
        """The layers' ``F32Layer`` array, rebuilt when a KV cache or an
        expert count is replaced."""
        bound = tuple(a.kv_cache.data_ptr() for a in self._attns) + tuple(
            0 if c is None else c.data_ptr() for c in self._counts
        )
        if self._layer_array is None or bound != self._bound:
            self._counts = [_expert_counts(layer) for layer in self.layers]
            self._kept = []
            packed = b"".join(self._pack_layer(layer) for layer in self.layers)
            self._layer_array = ctypes.create_string_buffer(packed, len(packed))
            self._bound = bound
        return self._layer_array

    def _pack_layer(self, layer: DecoderLayer) -> bytes:
        attention, mlp = layer.self_attn, layer.mlp
        attn = attention.attn
        kv_cache = attn.kv_cache
        if kv_cache.dim() != 5 or not kv_cache.is_contiguous():
            raise ValueError("the float32 stack needs each layer's contiguous paged KV cache")
        q_norm, k_norm = attention.q_norm, attention.k_norm
        sinks = attn.shape.sinks
        if sinks is not None:
            sinks = self._keep(sinks.detach().to(torch.float32).contiguous())
        fields: list[int] = [
            _ptr(layer.input_layernorm.weight),
            _ptr(attention.qkv_proj.weight),
            self._bias(attention.qkv_proj.bias),
            0 if q_norm is None else _ptr(q_norm.weight),
            0 if k_norm is None else _ptr(k_norm.weight),
            0 if q_norm is None else q_norm.weight.shape[0],
            0 if k_norm is None else k_norm.weight.shape[0],
            _ptr(attention.o_proj.weight),
            self._bias(attention.o_proj.bias),
            _ptr(layer.post_attention_layernorm.weight),
        ]
        experts = getattr(mlp, "experts", None)
        if experts is None:
            fields += [mlp.down_proj.weight.shape[1], _ptr(mlp.gate_up_proj.weight)]
            fields += [_ptr(mlp.down_proj.weight), 0, 0, 0, 0, 0, 0, 0]
            fields += [0] * 7
        else:
            w13 = experts.w13_mxfp4 or experts.w13_weight
            w2 = experts.w2_mxfp4 or experts.w2_weight
            fields += [w2.shape[2], 0, 0]
            fields += [
                w13.shape[0],
                mlp.top_k,
                SCORING_CODES[mlp.scoring_func],
                int(mlp.renormalize),
                ACTIVATION_CODES[experts.activation],
                _ptr(mlp.gate.weight),
                self._bias(mlp.gate.bias),
            ]
            fields += [
                _ptr(w13.codes) if isinstance(w13, Mxfp4Weight) else _ptr(w13),
                _ptr(w2.codes) if isinstance(w2, Mxfp4Weight) else _ptr(w2),
                _ptr(w13.scales) if isinstance(w13, Mxfp4Weight) else 0,
                _ptr(w2.scales) if isinstance(w2, Mxfp4Weight) else 0,
                self._bias(experts.w13_bias),
                self._bias(experts.w2_bias),
                _ptr(experts.tokens_per_expert),
            ]
        fields += [
            kv_cache.data_ptr(),
            kv_cache.shape[2],
            attn.sliding_window or 0,
            0 if sinks is None else sinks.data_ptr(),
        ]
        return _LAYER.pack(*fields)

    def _bias(self, bias: torch.Tensor | None) -> int:
        """A bias as the C side reads it (contiguous float32), or 0."""
        return 0 if bias is None else self._keep(bias.detach().float().contiguous()).data_ptr()

    def _keep(self, tensor: torch.Tensor) -> torch.Tensor:
        self._kept.append(tensor)
        return tensor


def _qualifies(layer: DecoderLayer) -> bool:
    """Whether the stack runs ``layer`` with the layer-by-layer forward's bits."""
    attention, mlp = layer.self_attn, layer.mlp
    attn = attention.attn
    if not attn.rotates or attn.ops.ops.attention_op.name != "cpu":
        return False
    ops = attn.ops.ops
    if not getattr(ops, "invariant_float32", False):
        return False  # the projections would be torch's F.linear
    projections = [attention.qkv_proj, attention.o_proj]
    experts = getattr(mlp, "experts", None)
    if experts is None:
        if getattr(mlp, "gate_up_proj", None) is None or getattr(mlp, "down_proj", None) is None:
            return False
        projections += [mlp.gate_up_proj, mlp.down_proj]
        if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return False
    else:
        if experts.use_ep or experts.tp_size != 1 or mlp.sequence_parallel:
            return False
        if experts.activation not in ACTIVATION_CODES or mlp.scoring_func not in SCORING_CODES:
            return False
        projections.append(mlp.gate)
        w13 = experts.w13_mxfp4 or experts.w13_weight
        w2 = experts.w2_mxfp4 or experts.w2_weight
        if isinstance(w13, Mxfp4Weight) != isinstance(w2, Mxfp4Weight):
            return False
        if not isinstance(w13, Mxfp4Weight) and not (_float32(w13) and _float32(w2)):
            return False
    if any(
        getattr(p, "tp_size", 1) != 1 or getattr(p, "packed", None) is not None for p in projections
    ):
        return False
    if getattr(attention.o_proj, "sequence_parallel", False):
        return False
    norms = _norms(layer)
    if attention.q_norm is not None and attention.k_norm is None:
        return False
    return all(_float32(p.weight) for p in projections) and all(_float32(n.weight) for n in norms)


def _norms(layer: DecoderLayer) -> list[Any]:
    attention = layer.self_attn
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    return norms + [n for n in (attention.q_norm, attention.k_norm) if n is not None]


def _expert_counts(layer: DecoderLayer) -> torch.Tensor | None:
    experts = getattr(layer.mlp, "experts", None)
    return None if experts is None else experts.tokens_per_expert


def _float32(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def _ptr(tensor: torch.Tensor) -> int:
    if not tensor.is_contiguous():
        raise ValueError("the float32 stack reads contiguous tensors")
    return tensor.data_ptr()
