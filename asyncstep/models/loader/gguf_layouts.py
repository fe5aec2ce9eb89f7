"""llama.cpp's tensors that differ from transformers' by more than a name:
Gemma 3's (``gemma3``) and gpt-oss's (``gpt-oss``), as convert_hf_to_gguf.py
writes them, and how :class:`~asyncstep.models.loader.gguf.GGUFCheckpoint`
reads them back into transformers' names and layouts.

- Block tensors whose HF module is not the Llama family's
  (:data:`ARCH_BLOCK_NAMES`): Gemma 3's sandwich norms (``post_attention_norm``
  -> ``post_attention_layernorm``, ``ffn_norm`` -> ``pre_feedforward_layernorm``,
  ``post_ffw_norm`` -> ``post_feedforward_layernorm``); gpt-oss's pre-MLP norm
  (``post_attention_norm``), router (``ffn_gate_inp`` -> ``mlp.router``) and
  sinks (``attn_sinks.weight`` -> ``self_attn.sinks``).
- Gemma 3's RMSNorm weights are stored as ``1 + w`` (the norm scales by
  ``1 + w``): layout ``"gemma_norm"`` subtracts the 1 (exact in float32 for
  stored values in ``[0.5, 2]``, Sterbenz; Gemma's model adds it back).
- gpt-oss's experts, one stack per projection, each expert's rows as
  ``x @ W^T``: ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` (transformers'
  interleaved gate and up columns split apart) with biases ``[E, I]``, or one
  ``ffn_gate_up_exps`` ``[E, 2I, H]`` (gate rows, then up rows: the
  converter's fused option) with bias ``[E, 2I]``; ``ffn_down_exps``
  ``[E, H, I]`` with bias ``[E, H]``. :func:`gpt_oss_experts` pairs them into
  transformers' ``mlp.experts.gate_up_proj`` ``[E, H, 2I]`` (interleaved),
  ``gate_up_proj_bias``, ``down_proj`` ``[E, I, H]`` and ``down_proj_bias``;
  :func:`to_hf_layout` builds each (a transposed view where it can). Where
  every expert stack is MXFP4 (ggml type 39, ``mxfp4``) the projections are
  transformers' MXFP4 tensors instead (``{proj}_blocks`` ``[E, rows, cols /
  32, 16]``, ``{proj}_scales``; layouts ``mxfp4_{blocks|scales}_{stack
  layout}``), built from the raw blocks by :func:`mxfp4_hf_parts` (ggml's
  scale byte ``e`` times doubled values is the E8M0 byte of the same
  numbers; codes from value ``j`` / ``j + 16`` nibbles to ``2b`` / ``2b + 1``):
  the model keeps them packed or dequantizes them, as an HF checkpoint's.

Imports numpy and :mod:`asyncstep.errors` only.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

from asyncstep.errors import ModelLoadError

__all__ = [
    "ARCH_BLOCK_NAMES",
    "EXPERT_STACKS",
    "GPT_OSS_STACKS",
    "GGUFWeight",
    "gpt_oss_experts",
    "hf_layout_shape",
    "mxfp4_hf_parts",
    "tensor_layout",
    "to_hf_layout",
]

#: Per GGUF architecture, block tensors (GGUF base name) whose HF module
#: (under ``model.layers.N``) is not the Llama family's.
ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "gpt-oss": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "attn_sinks": "self_attn.sinks",
    },
}
#: A MoE block's stacked experts: GGUF base name -> the projection's index in
#: the family's :attr:`~asyncstep.models.config.ModelArchConfig.expert_weight_names`.
EXPERT_STACKS: dict[str, int] = {"ffn_gate_exps": 1, "ffn_up_exps": 2, "ffn_down_exps": 3}
#: gpt-oss's expert stacks (GGUF base names): those, or gate and up fused.
GPT_OSS_STACKS = frozenset({*EXPERT_STACKS, "ffn_gate_up_exps"})
#: How :func:`~asyncstep.models.loader.gguf_names.hf_tensor_name` names a stack
#: before :func:`gpt_oss_experts` pairs it.
STACK_NAME = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(ffn_\w+_exps)\.(weight|bias)")


class GGUFWeight(NamedTuple):
    """One HF-named tensor of a GGUF file: a GGUF tensor, one expert of a
    stack (``expert``), or a stack (and its ``pair``) in another layout."""

    tensor: Any
    name: str
    expert: int | None = None
    #: How the stored tensor becomes the HF one (:func:`to_hf_layout`); "" as stored.
    layout: str = ""
    #: The up stack of a split gate / up pair (layouts "gate_up", "gate_up_bias").
    pair: Any = None


def tensor_layout(gguf_arch: str, hf_name: str) -> str:
    """The layout of a tensor that :func:`gpt_oss_experts` does not pair:
    Gemma 3's norms, else as stored."""
    if gguf_arch == "gemma3" and hf_name.endswith("norm.weight"):
        return "gemma_norm"
    return ""


def gpt_oss_experts(weights: list[GGUFWeight], mxfp4: bool = False) -> list[GGUFWeight]:
    """``weights`` with each layer's expert stacks as transformers' tensors
    (the module doc; ``mxfp4``: the projections as MXFP4 blocks and scales);
    a gate stack without its up stack (or the reverse) is an error."""
    out = _paired(weights)
    if not mxfp4:
        return out
    split: list[GGUFWeight] = []
    for weight in out:
        if weight.name.endswith(("gate_up_proj", "down_proj")):
            split += [
                weight._replace(
                    name=f"{weight.name}_{part}", layout=f"mxfp4_{part}_{weight.layout}"
                )
                for part in ("blocks", "scales")
            ]
        else:
            split.append(weight)
    return split


def _paired(weights: list[GGUFWeight]) -> list[GGUFWeight]:
    """:func:`gpt_oss_experts`'s stacks as transformers' dense tensors."""
    stacks: dict[tuple[str, str, str], GGUFWeight] = {}
    out: list[GGUFWeight] = []
    for weight in weights:
        match = STACK_NAME.fullmatch(weight.name)
        if match is None:
            out.append(weight)
        else:
            stacks[match[1], match[2], match[3]] = weight
    for (prefix, base, kind), weight in stacks.items():
        suffix = "_bias" if kind == "bias" else ""
        if base == "ffn_down_exps":
            layout = "" if kind == "bias" else "down"
            out.append(weight._replace(name=f"{prefix}.down_proj{suffix}", layout=layout))
        elif base == "ffn_gate_up_exps":
            name = f"{prefix}.gate_up_proj{suffix}"
            out.append(weight._replace(name=name, layout=f"fused_gate_up{suffix}"))
        elif base == "ffn_gate_exps":
            up = stacks.get((prefix, "ffn_up_exps", kind))
            if up is None:
                raise ModelLoadError(f"tensor {weight.tensor.name!r} has no ffn_up_exps.{kind}")
            name = f"{prefix}.gate_up_proj{suffix}"
            out.append(weight._replace(name=name, layout=f"gate_up{suffix}", pair=up.tensor))
        elif (prefix, "ffn_gate_exps", kind) not in stacks:
            raise ModelLoadError(f"tensor {weight.tensor.name!r} has no ffn_gate_exps.{kind}")
    return out


def hf_layout_shape(
    layout: str, stored: tuple[int, ...], pair: tuple[int, ...] | None = None
) -> tuple[int, ...] | None:
    """The HF shape of a tensor stored as ``stored`` (and ``pair``) in
    ``layout``; None where they cannot make one (a pair of other shapes, a
    fused stack of odd rows, a stack of another rank)."""
    if layout in ("", "gemma_norm"):
        return stored
    if layout.startswith("mxfp4_"):
        part, _, dense = layout.removeprefix("mxfp4_").partition("_")
        shape = hf_layout_shape(dense, stored, pair)
        if shape is None or len(shape) != 3:
            return None
        e, cols, rows = shape  # transformers' [E, cols, rows] is the blocks' [E, rows, cols]
        if cols % 32:
            return None
        return (e, rows, cols // 32, 16) if part == "blocks" else (e, rows, cols // 32)
    if layout in ("gate_up", "gate_up_bias") and pair != stored:
        return None
    rank = 2 if layout.endswith("_bias") else 3
    if len(stored) != rank:
        return None
    if layout == "down":
        return (stored[0], stored[2], stored[1])
    if layout.startswith("fused"):
        if stored[1] % 2:
            return None
        stored = (stored[0], stored[1] // 2, *stored[2:])
    if rank == 2:
        return (stored[0], 2 * stored[1])
    return (stored[0], stored[2], 2 * stored[1])


def to_hf_layout(
    layout: str, array: np.ndarray[Any, Any], pair: np.ndarray[Any, Any] | None = None
) -> np.ndarray[Any, Any]:
    """``array`` (and ``pair``: float32, stored shapes) in the HF layout."""
    if layout == "":
        return array
    if layout == "gemma_norm":
        return array - np.float32(1.0)
    if layout == "down":
        return array.swapaxes(1, 2)
    if layout.startswith("fused"):
        array, pair = np.split(array, 2, axis=1)
    assert pair is not None
    if layout.endswith("_bias"):
        return np.stack((array, pair), axis=-1).reshape(array.shape[0], -1)
    experts, inter, hidden = array.shape
    rows = np.stack((array, pair), axis=2).reshape(experts, 2 * inter, hidden)
    return rows.swapaxes(1, 2)  # [E, H, 2I]: gate and up columns interleaved


def mxfp4_hf_parts(
    layout: str,
    raw: np.ndarray[Any, Any],
    stored: tuple[int, ...],
    pair: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """An MXFP4 stack's raw ggml blocks (``raw``, and ``pair``: the up
    stack's; ``stored`` its logical ``[E, rows, cols]``) as transformers'
    ``_blocks`` or ``_scales`` uint8 (``layout``: ``mxfp4_{part}_{stack
    layout}``; rows gate and up interleaved for gate_up)."""
    part, _, dense = layout.removeprefix("mxfp4_").partition("_")
    e, rows, cols = stored
    blocks = raw.reshape(e, rows, cols // 32, 17)
    if dense == "fused_gate_up":
        gate, up = np.split(blocks, 2, axis=1)
        blocks = np.stack((gate, up), axis=2).reshape(e, rows, cols // 32, 17)
    elif dense == "gate_up":
        assert pair is not None
        up = pair.reshape(e, rows, cols // 32, 17)
        blocks = np.stack((blocks, up), axis=2).reshape(e, 2 * rows, cols // 32, 17)
    if part == "scales":
        return np.ascontiguousarray(blocks[..., 0])
    codes = blocks[..., 1:]
    values = np.concatenate((codes & 0x0F, codes >> 4), axis=-1)  # value j at j
    return np.ascontiguousarray(values[..., 0::2] | (values[..., 1::2] << 4))
