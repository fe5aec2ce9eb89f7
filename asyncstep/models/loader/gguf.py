"""GGUF checkpoints (llama.cpp files): metadata -> config, tensors -> HF-named fp32 weights.

Holds :class:`GGUFCheckpoint`, which opens a ``.gguf`` file with ``gguf.GGUFReader``
(memory-mapped), builds a :class:`ModelArchConfig` from the metadata, and yields
dequantized tensors under HF transformers parameter names, with llama.cpp's Q/K
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

What llama.cpp hard-codes for an architecture rather than writing it, read
as llama.cpp reads it: Gemma 3's every sixth layer full (the others sliding
when ``gemma3.attention.sliding_window`` is set; without it every layer is
full, on one rotary), its sliding layers' rotary base 10000 (or
``gemma3.rope.freq_base_swa``), its ``query_pre_attn_scalar`` the head
size (``hidden / heads`` for the 62-layer 27B), ``gelu_pytorch_tanh``;
gpt-oss's even layers sliding, its YaRN not truncated (its HF config's;
``rope.scaling.yarn_beta_fast`` / ``_slow`` read where given, as for every
architecture), its router's top-k logits softmaxed, its experts swigluoai.
May import numpy, gguf, transformers and ``asyncstep.models.config``/``errors``/``memory``
and the loader's GGUF modules; torch only where tensors are read (a model is
described without it).
"""

from __future__ import annotations

import itertools
import math
import re
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.config import (
    ARCHITECTURES,
    FULL_ATTENTION,
    MOE_FAMILIES,
    SLIDING_ATTENTION,
    ModelArchConfig,
)
from asyncstep.models.limits import (
    MAX_GGUF_ARRAY_ELEMENTS,
    MAX_GGUF_ARRAY_LENGTH,
    MAX_GGUF_KEYS,
    MAX_GGUF_TENSORS,
    MAX_TENSOR_DIMS,
    is_int,
)
from asyncstep.models.loader.gguf_layouts import (
    ARCH_BLOCK_NAMES,
    GPT_OSS_STACKS,
    GGUFWeight,
    gpt_oss_experts,
    hf_layout_shape,
    tensor_layout,
    to_hf_layout,
)
from asyncstep.models.loader.tokenizer import load_gguf_tokenizer
from asyncstep.models.memory import check_host_fits

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

GGUF_MAGIC = b"GGUF"

#: GGUF ``general.architecture`` -> HF ``architectures`` name.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
#: A ``llama`` GGUF with experts (llama.cpp converts Mixtral so).
GGUF_LLAMA_MOE = "MixtralForCausalLM"
#: Gemma 3: every sixth layer full (llama.cpp's ``set_swa_pattern(6)``); the
#: 27B (62 layers) scales its queries by ``hidden / heads``, not the head size.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_27B_LAYERS = 62

#: Tensors outside the blocks: GGUF base name -> HF module name.
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

#: Tensors inside block N: GGUF base name -> HF module name under ``model.layers.N``.
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
#: A MoE block's stacked experts: GGUF base name -> the projection's index in
#: the family's :attr:`~asyncstep.models.config.ModelArchConfig.expert_weight_names`.
_EXPERT_STACKS: dict[str, int] = {"ffn_gate_exps": 1, "ffn_up_exps": 2, "ffn_down_exps": 3}
#: How :func:`hf_tensor_name` names a stack until the config says how many experts.
_STACK_NAME = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(ffn_\w+_exps)\.weight")

#: GGUF tensors HF models do not have. ``rope_freqs`` holds llama3 rope factors;
#: rope scaling is taken from the metadata instead.
_IGNORED_GLOBAL = frozenset({"rope_freqs"})
_IGNORED_BLOCK = frozenset({"attn_rot_embd"})

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

_TENSOR_NAME = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<kind>weight|bias)")


class _FileTooShortError(Exception):
    """The reader wanted bytes past the end of the file."""


class _HostileFileError(Exception):
    """The file declares a table, array or tensor it cannot hold."""


#: Tensor types whose weights ``gguf.quants.dequantize`` turns into floats.
DEQUANTIZABLE: frozenset[gguf.GGMLQuantizationType] = frozenset(
    {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
    | set(getattr(gguf.quants, "_type_traits", {}))
)


class _CheckedReader(gguf.GGUFReader):
    """A ``GGUFReader`` that checks, in Python integers, every count and offset the
    file declares before the stock reader acts on it (numpy's uint64 arithmetic
    wraps: a tensor offset of 2**64 - 32 would point back into the header).

    - a read past the end of the file is reported as such (the stock reader
      slices its memory map without a bounds check);
    - the key and tensor counts are bounded before their tables are parsed;
    - a metadata array is kept whole, as one part holding its elements (numbers)
      or their raw bytes (strings), after its length is bounded: the stock
      reader makes numpy views per element (~650 bytes each), which a hostile
      file turns into gigabytes;
    - each tensor's type must be known, its shape whole blocks of that type,
      its data aligned, inside the file and clear of every other tensor's.
    """

    def __init__(self, path: Path) -> None:
        self._array_elements = 0
        super().__init__(path, "r")

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray[Any, Any]:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _FileTooShortError(
                f"data runs past the end of the file (needs byte {end:,}, "
                f"the file has {len(self.data):,})"
            )
        return super()._get(offset, dtype, count, override_order)

    def _build_fields(self, offs: int, count: int) -> int:
        if int(count) > MAX_GGUF_KEYS:
            raise _HostileFileError(f"{int(count):,} metadata keys (at most {MAX_GGUF_KEYS:,})")
        result: int = super()._build_fields(offs, count)
        return result

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        if int(count) > MAX_GGUF_TENSORS:
            raise _HostileFileError(f"{int(count):,} tensors (at most {MAX_GGUF_TENSORS:,})")
        result: tuple[int, list[Any]] = super()._build_tensor_info(offs, count)
        return result

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray[Any, Any]], list[int], list[gguf.GGUFValueType]]:
        if raw_type != gguf.GGUFValueType.ARRAY:
            parts: tuple[int, list[Any], list[int], list[Any]] = super()._get_field_parts(
                orig_offs, raw_type
            )
            return parts
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        count, start = int(length[0]), orig_offs + 12
        if count > MAX_GGUF_ARRAY_LENGTH:
            raise _HostileFileError(
                f"a metadata array of {count:,} elements (at most {MAX_GGUF_ARRAY_LENGTH:,})"
            )
        self._array_elements += count
        if self._array_elements > MAX_GGUF_ARRAY_ELEMENTS:
            raise _HostileFileError(
                f"metadata arrays of over {MAX_GGUF_ARRAY_ELEMENTS:,} elements in all"
            )
        itype = gguf.GGUFValueType(int(raw_itype[0]))  # ValueError: an unknown type
        if itype == gguf.GGUFValueType.STRING:
            items = self._get(start, np.uint8, self._strings_end(start, count) - start)
        elif itype in self.gguf_scalar_to_np:
            items = self._get(start, self.gguf_scalar_to_np[itype], count)
        else:
            raise _HostileFileError(f"a metadata array of {itype.name} (nested arrays)")
        types = [gguf.GGUFValueType.ARRAY, itype]
        return 12 + int(items.nbytes), [raw_itype, length, items], [2], types

    def _strings_end(self, offs: int, count: int) -> int:
        """Where ``count`` length-prefixed strings from ``offs`` end (read, not kept)."""
        size, fmt = len(self.data), "<Q" if self._little_endian() else ">Q"
        buffer = self.data.data
        for _ in range(count):
            if offs + 8 > size:
                break
            offs += 8 + struct.unpack_from(fmt, buffer, offs)[0]
        else:
            if offs <= size:
                return offs
        raise _FileTooShortError(
            f"a metadata array of {count:,} strings runs past the end of the file"
        )

    def _little_endian(self) -> bool:
        return (self.byte_order == "I") == (sys.byteorder == "little")

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        extents = sorted(self._tensor_extent(start_offs, field) for field in fields)
        for (_, end, name), (begin, _, other) in itertools.pairwise(extents):
            if begin < end:
                raise _HostileFileError(f"tensors {name!r} and {other!r} overlap")
        super()._build_tensors(start_offs, fields)

    def _tensor_extent(self, start_offs: int, field: Any) -> tuple[int, int, str]:
        """(begin, end, name) of a tensor's data, checked in Python integers."""
        _, name_data, n_dims, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        shape = [int(d) for d in dims.tolist()]
        if not 1 <= int(n_dims[0]) <= MAX_TENSOR_DIMS or not all(shape):
            raise _HostileFileError(f"tensor {name!r} has shape {shape}")
        try:
            qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise _HostileFileError(
                f"tensor {name!r} has unknown type {int(raw_type[0])}"
            ) from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if shape[0] % block:
            raise _HostileFileError(
                f"tensor {name!r}: rows of {shape[0]} are not whole {qtype.name} blocks"
            )
        relative = int(offset[0])
        if relative % int(self.alignment):
            raise _HostileFileError(f"tensor {name!r} is not aligned to {int(self.alignment)}")
        begin = start_offs + relative
        end = begin + math.prod(shape) // block * type_size
        if end > len(self.data):
            raise _FileTooShortError(
                f"tensor {name!r} needs bytes up to {end:,} but the file has {len(self.data):,}"
            )
        return begin, end, name


def hf_tensor_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """The HF parameter name of a GGUF tensor of architecture ``gguf_arch``;
    None for tensors HF has no use for. A stack of experts is named
    ``model.layers.N.mlp.experts.<its GGUF base name>.weight`` until the
    config says how many experts it holds (gpt-oss's stacks: also ``.bias``).

    Raises :class:`UnsupportedModelError` for a tensor no supported model has.
    """
    match = _TENSOR_NAME.fullmatch(gguf_name)
    if match is not None:
        base, kind, layer = match["base"], match["kind"], match["layer"]
        if layer is None:
            if base in _IGNORED_GLOBAL:
                return None
            if base in _GLOBAL_NAMES:
                return f"{_GLOBAL_NAMES[base]}.{kind}"
        else:
            if base in _IGNORED_BLOCK:
                return None
            module = ARCH_BLOCK_NAMES.get(gguf_arch, {}).get(base, _BLOCK_NAMES.get(base))
            if module == "self_attn.sinks" and kind == "weight":
                return f"model.layers.{int(layer)}.{module}"  # a parameter, not a module
            if module is not None:
                return f"model.layers.{int(layer)}.{module}.{kind}"
            if gguf_arch == "gpt-oss" and base in GPT_OSS_STACKS:
                return f"model.layers.{int(layer)}.mlp.experts.{base}.{kind}"
            if base in _EXPERT_STACKS and kind == "weight":
                return f"model.layers.{int(layer)}.mlp.experts.{base}.weight"
    raise UnsupportedModelError(f"unexpected GGUF tensor {gguf_name!r}")


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


def _open_reader(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning every way it can be broken into a one-line ModelLoadError."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})"
        )
    try:
        return _CheckedReader(path)
    except _FileTooShortError as exc:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file: {exc}") from None
    except _HostileFileError as exc:
        raise ModelLoadError(f"{path}: corrupt GGUF file: {exc}") from None
    except Exception as exc:  # the reader raises ValueError, KeyError, IndexError, ...
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path}: corrupt GGUF file: {detail}") from None


class GGUFCheckpoint:
    """A ``.gguf`` file of a Llama-family model; tensors come out float32, HF-named."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model not found: {self.path}")
        self._reader = _open_reader(self.path)
        self._gguf_arch = self._metadata_str("general.architecture")
        if self._gguf_arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: unsupported GGUF architecture {self._gguf_arch!r}; asyncstep "
                f"runs {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        self._tensors = self._map_tensor_names()
        self._config = self._build_config()
        self._tensors = self._expand_experts(self._tensors)
        self._check_tensors()
        self._check_tokenizer_arrays()

    # -- metadata ---------------------------------------------------------------------------

    def metadata(self, key: str, default: Any = None) -> Any:
        """A scalar or string metadata value (arrays: their length is not read here)."""
        field = self._reader.fields.get(key)
        if field is None or not field.types:
            return default
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            raise ModelLoadError(f"{self.path}: GGUF metadata {key} is an array, expected a value")
        value = field.parts[field.data[0]]
        if kind == gguf.GGUFValueType.STRING:
            return bytes(value).decode("utf-8", errors="replace")
        return value.tolist()[0]

    def _metadata_str(self, key: str) -> str:
        value = self.metadata(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {key}")
        return value

    def _metadata_int(self, key: str, default: int | None = None) -> int:
        """``<arch>.<key>``, which must be an integer (bounded later, by ``validate``)."""
        full_key = f"{self._gguf_arch}.{key}"
        value = self.metadata(full_key, default)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {full_key}")
        if not is_int(value):
            raise ModelLoadError(
                f"{self.path}: GGUF metadata {full_key} must be an integer, got {value!r}"
            )
        return int(value)

    def _metadata_float(self, key: str, default: float) -> float:
        """``<arch>.<key>``, which must be a number (checked finite by ``validate``)."""
        full_key = f"{self._gguf_arch}.{key}"
        value = self.metadata(full_key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(
                f"{self.path}: GGUF metadata {full_key} must be a number, got {value!r}"
            )
        return float(value)

    def _array_length(self, key: str) -> int | None:
        field = self._reader.fields.get(key)
        if field is None or field.types[:1] != [gguf.GGUFValueType.ARRAY]:
            return None
        # _CheckedReader keeps an array as [..., item type, length, items]; data -> items.
        return int(field.parts[field.data[0] - 1][0])

    # -- config -----------------------------------------------------------------------------

    def _vocab_size(self) -> int:
        vocab = self.metadata(f"{self._gguf_arch}.vocab_size")
        if vocab is not None:
            return self._metadata_int("vocab_size")
        n_tokens = self._array_length("tokenizer.ggml.tokens")
        if n_tokens:
            return n_tokens
        for tensor in self._reader.tensors:
            if tensor.name == "token_embd.weight":
                return int(tensor.shape[-1])
        raise ModelLoadError(f"{self.path}: GGUF file gives no vocabulary size")

    def _rope_scaling(self) -> dict[str, Any] | None:
        arch = self._gguf_arch
        kind = self.metadata(f"{arch}.rope.scaling.type")
        factor = self.metadata(f"{arch}.rope.scaling.factor")
        if kind is None and self.metadata(f"{arch}.rope.scale_linear") is not None:
            kind, factor = "linear", self.metadata(f"{arch}.rope.scale_linear")
        if kind in (None, "none") or not factor:
            return None
        if not isinstance(kind, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata {arch}.rope.scaling.type is no name")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
        original = self.metadata(f"{arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = original
        for key in ("beta_fast", "beta_slow"):
            value = self.metadata(f"{arch}.rope.scaling.yarn_{key}")
            if value is not None and kind == "yarn":
                scaling[key] = value
        return scaling  # its fields are type-checked by ModelArchConfig.validate

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.metadata(f"tokenizer.ggml.{key}")
            if is_int(value) and value not in ids:
                ids.append(value)
        return tuple(ids)

    def _sliding_window(self) -> int | None:
        """``<arch>.attention.sliding_window`` (every layer's), where present."""
        if self.metadata(f"{self._gguf_arch}.attention.sliding_window") is None:
            return None
        return self._metadata_int("attention.sliding_window")

    def _build_config(self) -> ModelArchConfig:
        hidden = self._metadata_int("embedding_length")
        n_heads = self._metadata_int("attention.head_count")
        n_kv = self._metadata_int("attention.head_count_kv", n_heads)
        head_dim = self._metadata_int("attention.key_length", hidden // max(n_heads, 1))
        gguf_names = {tensor.name for tensor in self._reader.tensors}
        architecture = GGUF_ARCHITECTURES[self._gguf_arch]
        if self._gguf_arch == "llama" and self.metadata("llama.expert_count"):
            architecture = GGUF_LLAMA_MOE
        ffn = self._metadata_int("feed_forward_length")
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=self._vocab_size(),
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=self._metadata_int("block_count"),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rms_norm_eps=self._metadata_float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self._metadata_float("rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self._metadata_int("context_length", 4096),
            tie_word_embeddings="output.weight" not in gguf_names,
            attention_bias="blk.0.attn_q.bias" in gguf_names,
            qk_norm=self._gguf_arch in ("qwen3", "qwen3moe", "olmoe"),
            qk_norm_per_head=self._gguf_arch != "olmoe",
            bos_token_id=self.metadata("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self._eos_token_ids(),
            sliding_window=self._sliding_window(),
            **self._moe_fields(architecture, ffn),
        )
        if self._gguf_arch == "gemma3":
            fields |= self._gemma3_fields(fields)
        elif self._gguf_arch == "gpt-oss":
            fields |= self._gpt_oss_fields(fields)
        config = ModelArchConfig(**fields)
        try:
            config.validate()
        except ModelLoadError as exc:
            raise type(exc)(f"{self.path}: {exc}") from None
        return config

    def _gemma3_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Gemma 3's fields, as llama.cpp reads a ``gemma3`` file (the module doc)."""
        layers, window = fields["num_hidden_layers"], fields["sliding_window"]
        types: tuple[str, ...] = ()
        if window:
            types = tuple(
                FULL_ATTENTION if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else SLIDING_ATTENTION
                for i in range(layers)
            )
        scalar = fields["head_dim"]
        if layers == GEMMA3_27B_LAYERS:
            scalar = fields["hidden_size"] // max(fields["num_attention_heads"], 1)
        arch = self._gguf_arch
        return {
            "hidden_act": "gelu_pytorch_tanh",
            "qk_norm": True,
            "sliding_window": window or None,
            "layer_types": types,
            "query_pre_attn_scalar": float(scalar),
            "rope_local_base_freq": self._metadata_float("rope.freq_base_swa", 10000.0)
            if window
            else None,
            "max_position_embeddings": self._metadata_int("context_length", 131072),
            "final_logit_softcapping": self.metadata(f"{arch}.final_logit_softcapping"),
            "attn_logit_softcapping": self.metadata(f"{arch}.attn_logit_softcapping"),
        }

    def _gpt_oss_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """gpt-oss's fields, as llama.cpp reads a ``gpt-oss`` file (the module doc)."""
        layers = fields["num_hidden_layers"]
        rope = fields["rope_scaling"]
        if rope is not None and rope["rope_type"] == "yarn":
            rope = rope | {"truncate": False}
        return {
            "sliding_window": self._metadata_int("attention.sliding_window"),
            "layer_types": tuple(
                SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(layers)
            ),
            "rope_scaling": rope,
            "attention_sinks": True,
            "scoring_func": "topk_softmax",
            "moe_activation": "swigluoai",
            "norm_topk_prob": False,
        }

    def _moe_fields(self, architecture: str, ffn: int) -> dict[str, Any]:
        """A MoE architecture's expert fields (bounded by ``validate``): the
        expert counts, each expert's width (``expert_feed_forward_length``,
        else the feed-forward length) and ``expert_weights_norm`` (else the
        family's: OLMoE does not renormalise, Qwen3-MoE and Mixtral do)."""
        family = ARCHITECTURES[architecture]
        if family not in MOE_FAMILIES:
            return {}
        norm = self.metadata(f"{self._gguf_arch}.expert_weights_norm", family != "olmoe")
        return {
            "num_experts": self._metadata_int("expert_count"),
            "num_experts_per_tok": self._metadata_int("expert_used_count"),
            "moe_intermediate_size": self._metadata_int("expert_feed_forward_length", ffn),
            "norm_topk_prob": norm,
        }

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
            try:
                return gpt_oss_experts(weights)
            except ModelLoadError as exc:
                raise ModelLoadError(f"{self.path}: {exc}") from None
        if not config.is_moe:
            return weights
        block, *projections = config.expert_weight_names
        expanded: list[GGUFWeight] = []
        for weight in weights:
            match = _STACK_NAME.fullmatch(weight.name)
            if match is None:
                expanded.append(
                    weight._replace(name=weight.name.replace(".mlp.gate.", f".{block}.gate."))
                )
                continue
            proj = projections[_EXPERT_STACKS[match[2]] - 1]
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
            length = self._array_length(key)
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
        """A (non-expert) weight dequantized, float32, in its HF layout."""
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
        entries = sum(self._array_length(key) or 0 for key in TOKENIZER_ARRAYS)
        check_host_fits(
            entries * TOKENIZER_BYTES_PER_ENTRY,
            f"{self.path}: converting its tokenizer ({entries:,} entries)",
        )

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, arch={self._gguf_arch!r})"
