"""GGUF checkpoints (llama.cpp files): metadata -> config, tensors -> HF-named fp32 weights.

Holds :class:`GGUFCheckpoint`, which opens a ``.gguf`` file with
:mod:`~asyncstep.models.loader.gguf_reader`'s checked ``gguf.GGUFReader``
(memory-mapped), builds a :class:`ModelArchConfig` from the metadata
(:mod:`~asyncstep.models.loader.gguf_config`), and yields
dequantized tensors under HF transformers parameter names
(:mod:`~asyncstep.models.loader.gguf_names`), with llama.cpp's Q/K
row permutation undone for the ``llama`` architecture. The file is untrusted:
every count, offset and size it declares is checked in Python integers against
the file (whole, aligned, no overlap) before the reader acts on it, and every
tensor's shape and type against the config, all when the file opens.
Supported GGUF architectures: ``llama`` (Llama, Mistral; Mixtral where it
has ``llama.expert_count``), ``qwen2``, ``qwen3``, ``qwen3moe``, ``olmoe``,
``gemma3`` (Gemma 3's text model) and ``gpt-oss``. A MoE block's experts are
stacked in one GGUF tensor per projection (``blk.N.ffn_gate_exps.weight``
``[experts, ...]``): each comes out as its experts' HF-named tensors, one per
expert, dequantized once per stack (gpt-oss's: as transformers' one tensor
per projection, :mod:`~asyncstep.models.loader.gguf_layouts`, which also
undoes Gemma 3's ``1 + w`` norms).

The config comes from the metadata as llama.cpp reads it, per architecture
(:mod:`~asyncstep.models.loader.gguf_config`).
May import numpy, gguf, transformers and ``asyncstep.models.config``/``errors``/``memory``
and the loader's GGUF modules; torch only where tensors are read (a model is
described without it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.config import (
    ModelArchConfig,
)
from asyncstep.models.loader.gguf_config import GGUFMetadata
from asyncstep.models.loader.gguf_layouts import (
    EXPERT_STACKS,
    GGUFWeight,
    gpt_oss_experts,
    hf_layout_shape,
    mxfp4_hf_parts,
    tensor_layout,
    to_hf_layout,
)
from asyncstep.models.loader.gguf_names import (
    EXPERT_STACK_NAME,
    GGUF_ARCHITECTURES,
    hf_tensor_name,
)
from asyncstep.models.loader.gguf_reader import open_reader
from asyncstep.models.loader.tokenizer import load_gguf_tokenizer
from asyncstep.models.memory import check_host_fits

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

#: The metadata arrays transformers builds a GGUF file's tokenizer from.
TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
)
#: BPE merges per vocabulary entry (Llama 3: 280,147 merges for 128,256 tokens).
MERGES_PER_TOKEN = 4
#: What transformers' conversion takes per tokenizer array entry (measured on
#: SmolLM2: ~1.2 KiB, the stock GGUFReader's numpy views and the tokenizer built).
TOKENIZER_BYTES_PER_ENTRY = 2048

#: Tensor types whose weights ``gguf.quants.dequantize`` turns into floats.
DEQUANTIZABLE: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    | set(getattr(gguf.quants, "_type_traits", {}))
)


def unpermute_qk(weight: np.ndarray[Any, Any], n_head: int) -> np.ndarray[Any, Any]:
    """Undo convert_hf_to_gguf's rotary row permutation of a Q or K weight (or bias).

    llama.cpp stores each head's rows interleaved (pairs ``(i, i + d/2)`` adjacent);
    the forward permutation is
    ``w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)``.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows} rows into {n_head} heads")
    rest = weight.shape[1:]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
    )


def _stored(tensor: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape as numpy (and HF) order it: its dimensions reversed."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


#: ggml's MXFP4 type id; gpt-oss's expert stacks (their HF names' endings).
MXFP4_TYPE = 39
GPT_OSS_STACK_SUFFIXES = ("_exps.weight",)


class GGUFCheckpoint:
    """A ``.gguf`` file of a Llama-family model; tensors come out float32, HF-named."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model not found: {self.path}")
        self._reader = open_reader(self.path)
        self._metadata = GGUFMetadata(self._reader, self.path)
        self._gguf_arch = self._metadata.arch
        if self._gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: unsupported GGUF architecture {self._gguf_arch!r}; asyncstep "
                f"runs {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        self._tensors = self._map_tensor_names()
        self._config = self._metadata.config()
        self._tensors = self._expand_experts(self._tensors)
        self._check_tensors()
        self._check_tokenizer_arrays()

    def metadata(self, key: str, default: Any = None) -> Any:
        """A scalar or string metadata value (arrays: their length is not read here)."""
        return self._metadata.get(key, default)

    # -- tensors ----------------------------------------------------------------------------

    def _map_tensor_names(self) -> list[GGUFWeight]:
        mapped: list[GGUFWeight] = []
        for tensor in self._reader.tensors:
            try:
                name = hf_tensor_name(tensor.name, self._gguf_arch)
            except UnsupportedModelError as exc:
                raise UnsupportedModelError(f"{self.path}: {exc}") from None
            if name is not None:
                layout = tensor_layout(self._gguf_arch, name)
                mapped.append(GGUFWeight(tensor, name, layout=layout))
        return mapped

    def _expand_experts(self, weights: list[GGUFWeight]) -> list[GGUFWeight]:
        """Each stack of experts as its experts' HF names (a model without
        experts keeps the stack's name, which has no place in it), and the
        router under the family's block name."""
        config = self._config
        if config.family == "gpt_oss":
            stacks = [w.tensor for w in weights if w.name.endswith(GPT_OSS_STACK_SUFFIXES)]
            mxfp4 = bool(stacks) and all(int(t.tensor_type) == MXFP4_TYPE for t in stacks)
            if mxfp4:  # kept MXFP4: the model reads transformers' blocks and scales
                self._config = dataclasses.replace(config, experts_mxfp4=True)
            try:
                return gpt_oss_experts(weights, mxfp4)
            except ModelLoadError as exc:
                raise ModelLoadError(f"{self.path}: {exc}") from None
        if not config.is_moe:
            return weights
        block, *projections = config.expert_weight_names
        expanded: list[GGUFWeight] = []
        for weight in weights:
            match = EXPERT_STACK_NAME.fullmatch(weight.name)
            if match is None:
                expanded.append(
                    weight._replace(name=weight.name.replace(".mlp.gate.", f".{block}.gate."))
                )
                continue
            proj = projections[EXPERT_STACKS[match[2]] - 1]
            expanded += [
                GGUFWeight(weight.tensor, f"{match[1]}.{block}.experts.{e}.{proj}.weight", e)
                for e in range(config.num_experts)
            ]
        return expanded

    def _stored_shape(self, weight: GGUFWeight) -> tuple[int, ...]:
        """A weight's shape as stored (an expert's: its stack's but the first
        dimension, which must be the expert count; a stack in another layout:
        the HF shape it makes, :func:`hf_layout_shape`)."""
        stored = _stored(weight.tensor)
        if weight.layout:
            pair = None if weight.pair is None else _stored(weight.pair)
            shape = hf_layout_shape(weight.layout, stored, pair)
            if shape is None:
                shown = "" if pair is None else f" and {weight.pair.name!r} has {pair}"
                raise ModelLoadError(
                    f"{self.path}: tensor {weight.tensor.name!r} has shape {stored}{shown}, "
                    f"which make no {weight.name}"
                )
            return shape
        if weight.expert is None:
            return stored
        if not stored or stored[0] != self._config.num_experts:
            raise ModelLoadError(
                f"{self.path}: tensor {weight.tensor.name!r} has shape {stored}, but the "
                f"metadata implies {self._config.num_experts} experts"
            )
        return stored[1:]

    def _check_tensors(self) -> None:
        """Every tensor must be one the config implies, of that shape and of a type
        gguf can dequantize, and every tensor the config implies must be there."""
        expected = self._config.weight_shapes()
        seen: set[str] = set()
        for weight in self._tensors:
            tensor, name = weight.tensor, weight.name
            shape = expected.get(name)
            if shape is None:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name!r} has no place in the model its "
                    f"metadata describes"
                )
            if name in seen:
                raise ModelLoadError(f"{self.path}: two tensors are {name}")
            seen.add(name)
            stored = self._stored_shape(weight)
            if stored != shape:
                raise ModelLoadError(
                    f"{self.path}: tensor {tensor.name!r} has shape {stored}, but the "
                    f"metadata implies {shape}"
                )
            for part in (tensor,) if weight.pair is None else (tensor, weight.pair):
                if part.tensor_type not in DEQUANTIZABLE:
                    raise UnsupportedModelError(
                        f"{self.path}: tensor {part.name!r} has type {part.tensor_type.name}, "
                        f"which gguf {getattr(gguf, '__version__', '')} cannot dequantize"
                    )
        missing = sorted(expected.keys() - seen)
        if missing:
            raise ModelLoadError(
                f"{self.path}: lacks {len(missing)} of the tensors its metadata implies, "
                f"e.g. {', '.join(missing[:3])}"
            )

    def _check_tokenizer_arrays(self) -> None:
        """At most one token (type, score) per vocabulary row, and merges in proportion."""
        vocab = self._config.vocab_size
        for key in TOKENIZER_ARRAYS:
            length = self._metadata.array_length(key)
            limit = MERGES_PER_TOKEN * vocab if key.endswith("merges") else vocab
            if length is not None and length > limit:
                raise ModelLoadError(
                    f"{self.path}: GGUF metadata {key} has {length:,} entries, more than a "
                    f"vocabulary of {vocab:,} can use ({limit:,})"
                )

    def _unpermute_heads(self, hf_name: str) -> int | None:
        """Heads to un-permute a tensor by (llama q/k only), or None to leave it as stored."""
        if self._gguf_arch != "llama":
            return None
        if ".self_attn.q_proj." in hf_name:
            return self._config.num_attention_heads
        if ".self_attn.k_proj." in hf_name:
            return self._config.num_key_value_heads
        return None

    def _load_tensor(self, tensor: Any, hf_name: str) -> np.ndarray[Any, Any]:
        """``tensor`` dequantized, float32, in its stored (HF) shape."""
        from asyncstep.models.loader.gguf_blocks import dequantize_blocks

        fast = dequantize_blocks(tensor.data, int(tensor.tensor_type))
        try:
            array = (
                fast.numpy()
                if fast is not None
                else gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            )
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which "
                f"gguf {getattr(gguf, '__version__', '')} cannot dequantize"
            ) from None
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape.tolist())))
        heads = self._unpermute_heads(hf_name)
        if heads is not None:
            array = unpermute_qk(array, heads)
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            array = array.copy()
        return array

    def _load_weight(self, weight: GGUFWeight) -> np.ndarray[Any, Any]:
        """A (non-expert) weight dequantized, float32, in its HF layout (an
        MXFP4 stack's blocks or scales: uint8, :func:`mxfp4_hf_parts`)."""
        if weight.layout.startswith("mxfp4_"):
            pair = None if weight.pair is None else np.asarray(weight.pair.data)
            raw = np.asarray(weight.tensor.data)
            return mxfp4_hf_parts(weight.layout, raw, _stored(weight.tensor), pair)
        array = self._load_tensor(weight.tensor, weight.name)
        pair = None if weight.pair is None else self._load_tensor(weight.pair, weight.name)
        return to_hf_layout(weight.layout, array, pair)

    # -- Checkpoint protocol ----------------------------------------------------------------

    @property
    def gguf_architecture(self) -> str:
        return self._gguf_arch

    def arch_config(self) -> ModelArchConfig:
        return self._config

    def weight_names(self) -> list[str]:
        return [weight.name for weight in self._tensors]

    def decoder_weights_4bit(self) -> bool:
        """Whether every decoder projection is stored as Q4_0 or Q4_1 (the
        4-bit blocks the CPU library keeps as they are)."""
        four_bit = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1}
        projections = [w.tensor for w in self._tensors if w.name.endswith("_proj.weight")]
        return bool(projections) and all(t.tensor_type in four_bit for t in projections)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch  # where tensors are read: describing a model needs no torch

        stack: tuple[Any, np.ndarray[Any, Any]] | None = None  # the experts being read
        for weight in self._tensors:
            if weight.expert is None:
                stack = None
                yield weight.name, torch.from_numpy(self._load_weight(weight))
                continue
            if stack is None or stack[0] is not weight.tensor:
                stack = weight.tensor, self._load_tensor(weight.tensor, weight.name)
            yield weight.name, torch.from_numpy(stack[1][weight.expert])

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return load_gguf_tokenizer(
            self.path,
            chat_template=self.metadata("tokenizer.chat_template"),
            before_convert=self._check_conversion_fits,
            architecture=self._gguf_arch,
        )

    def _check_conversion_fits(self) -> None:
        """transformers re-reads the tokenizer arrays element by element: refuse a
        conversion the host cannot hold."""
        entries = sum(self._metadata.array_length(key) or 0 for key in TOKENIZER_ARRAYS)
        check_host_fits(
            entries * TOKENIZER_BYTES_PER_ENTRY,
            f"{self.path}: converting its tokenizer ({entries:,} entries)",
        )

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, arch={self._gguf_arch!r})"
