"""HF checkpoint directories: ``config.json`` + ``*.safetensors`` (+ tokenizer files).

Holds :class:`HFCheckpoint`. The config comes from ``config.json`` (eos ids merged
from ``generation_config.json``); weights come from the safetensors files, sharded
(``model.safetensors.index.json``) or not, under their stored (HF) names and dtype.
Every file's header is checked when the checkpoint opens, in Python integers and
against the shapes the config implies (every tensor expected, of its shape, none
missing), so a truncated, corrupt or hostile file fails there, naming the file,
before anything is allocated from it; JSON files and headers have size limits. Pickle
checkpoints (``*.bin``, ``*.pt``) are refused on purpose: loading one runs code.
May import torch, safetensors, transformers and ``asyncstep.models.config``/``errors``.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from safetensors import safe_open

from asyncstep.errors import ModelLoadError, UnsupportedModelError, describe
from asyncstep.models.config import MAX_EOS_TOKENS, ModelArchConfig
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.limits import (
    MAX_JSON_BYTES,
    MAX_SAFETENSORS_HEADER_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TOKENIZER_FILE_BYTES,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
TOKENIZER_SIDE_FILES = ("merges.txt", "tokenizer_config.json", "special_tokens_map.json")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file of at most ``MAX_JSON_BYTES``, or a one-line error."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise ModelLoadError(
                f"{path}: {size:,} bytes, more than a checkpoint's JSON file may hold "
                f"({MAX_JSON_BYTES:,})"
            )
        value = json.loads(path.read_bytes())
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError too
        raise ModelLoadError(f"{path}: invalid JSON: {describe(exc)}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        if len(value) > MAX_EOS_TOKENS:
            raise ModelLoadError(f"lists {len(value):,} token ids (at most {MAX_EOS_TOKENS})")
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def read_arch_config(directory: Path) -> ModelArchConfig:
    """``config.json`` as a validated :class:`ModelArchConfig`, eos ids merged from
    ``generation_config.json`` (its ids first) when that file exists."""
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"{directory}: no {CONFIG_FILE} (not an HF checkpoint directory)")
    try:
        config = parse_hf_config(_read_json(config_path))
    except ModelLoadError as exc:
        if str(exc).startswith(str(config_path)):
            raise
        raise type(exc)(f"{config_path}: {exc}") from None
    generation_path = directory / GENERATION_CONFIG_FILE
    if generation_path.is_file():
        generation = _read_json(generation_path)
        try:
            eos = _token_ids(generation.get("eos_token_id"))
        except ModelLoadError as exc:
            raise ModelLoadError(f"{generation_path}: eos_token_id {exc}") from None
        merged = eos + tuple(i for i in config.eos_token_ids if i not in eos)
        bos = config.bos_token_id
        if bos is None and _token_ids(generation.get("bos_token_id")):
            bos = _token_ids(generation.get("bos_token_id"))[0]
        config = config.replace(eos_token_ids=merged, bos_token_id=bos)
        try:
            config.validate()
        except ModelLoadError as exc:
            raise type(exc)(f"{generation_path}: {exc}") from None
    return config


class _HeaderEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One tensor's entry in a safetensors header, as the file spells it."""

    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]


#: safetensors dtypes -> bytes per element; only the float ones are weights.
SAFETENSORS_DTYPES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")
#: An MXFP4 projection's uint8 tensors (gpt-oss's experts, ``experts_mxfp4``).
MXFP4_SUFFIXES = ("_blocks", "_scales")


def read_safetensors_header(path: Path, max_tensors: int) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, every entry typed and checked in
    Python integers: a known dtype, offsets covering exactly its shape's bytes,
    inside the file and clear of each other; at most ``max_tensors`` of them."""
    size, header_len, raw = _read_header_bytes(path)
    try:
        entries = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: corrupt safetensors header: {describe(exc)}") from None
    entries.pop("__metadata__", None)
    if len(entries) > max_tensors:
        raise ModelLoadError(
            f"{path}: {len(entries):,} tensors, more than the config's model has ({max_tensors:,})"
        )
    tensors = {name: _tensor_info(path, name, entry) for name, entry in entries.items()}
    extents = sorted((t.begin, t.end, name) for name, t in tensors.items())
    for (_, end, name), (begin, _, other) in itertools.pairwise(extents):
        if begin < end:
            raise ModelLoadError(f"{path}: corrupt safetensors header: {name!r} overlaps {other!r}")
    needed = 8 + header_len + max((end for _, end, _ in extents), default=0)
    if needed > size:
        raise ModelLoadError(
            f"{path}: truncated safetensors file: its tensors need {needed:,} bytes "
            f"but the file has {size:,}"
        )
    return tensors


def _read_header_bytes(path: Path) -> tuple[int, int, bytes]:
    """(file size, header length, header bytes), the length checked before the read."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 0 < header_len <= min(size - 8, MAX_SAFETENSORS_HEADER_BYTES):
                raise ModelLoadError(
                    f"{path}: corrupt or truncated safetensors file: header length "
                    f"{header_len} does not fit a {size:,}-byte file"
                )
            return size, header_len, f.read(header_len)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _tensor_info(path: Path, name: str, raw: msgspec.Raw) -> TensorInfo:
    try:
        entry = msgspec.json.decode(raw, type=_HeaderEntry)
    except msgspec.DecodeError:
        raise ModelLoadError(
            f"{path}: corrupt safetensors header: bad entry for {name!r}"
        ) from None
    itemsize = SAFETENSORS_DTYPES.get(entry.dtype)
    if itemsize is None:
        raise ModelLoadError(
            f"{path}: corrupt safetensors file: tensor {name!r} has unknown dtype {entry.dtype!r}"
        )
    begin, end = entry.data_offsets
    if len(entry.shape) > MAX_TENSOR_DIMS or min(entry.shape, default=0) < 0:
        raise ModelLoadError(f"{path}: corrupt safetensors header: bad shape for {name!r}")
    if not 0 <= begin <= end or end - begin != math.prod(entry.shape) * itemsize:
        raise ModelLoadError(f"{path}: corrupt safetensors header: bad offsets for {name!r}")
    return TensorInfo(entry.dtype, tuple(entry.shape), begin, end)


def _check_safe_open(path: Path) -> None:
    """Let safetensors itself vet the header (dtypes, offsets covering the data, ...)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # SafetensorError, OSError
        raise ModelLoadError(f"{path}: corrupt safetensors file: {exc}") from None


def _shard_files(directory: Path, max_files: int) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else all of them
    (at most ``max_files``, one per tensor)."""
    index_path = directory / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: no weight_map")
        names = [str(name) for name in dict.fromkeys(weight_map.values())]
        if len(names) > max_files:
            raise ModelLoadError(
                f"{index_path}: names {len(names):,} files, more than the config's model has "
                f"tensors ({max_files:,})"
            )
        for name in names:
            if Path(name).name != name or name in ("", ".", ".."):
                raise ModelLoadError(f"{index_path}: names {name!r}, not a file of the directory")
        files = [directory / name for name in names]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index_path}: names {file.name}, which is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if len(files) > max_files:
        raise ModelLoadError(
            f"{directory}: {len(files):,} safetensors files, more than the config's model has "
            f"tensors ({max_files:,})"
        )
    if not files:
        pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in directory.glob(pattern))
        found = f" (found {', '.join(pickles)})" if pickles else ""
        raise ModelLoadError(
            f"{directory}: no *.safetensors weights{found}; .bin/pickle checkpoints are not "
            f"loaded on purpose (unpickling runs code): convert them to safetensors"
        )
    return files


def _read_tensor(handle: Any, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
    """A whole tensor, or (``index`` given) just that slice of it, e.g. one rank's shard."""
    if index is None:
        tensor: torch.Tensor = handle.get_tensor(name)
    else:
        tensor = handle.get_slice(name)[index]
    return tensor


class HFCheckpoint:
    """An HF checkpoint directory with safetensors weights (``with_weights=False``:
    its config and tokenizer only, for dummy weights; its weights are not looked at)."""

    def __init__(self, path: str | Path, *, with_weights: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelLoadError(f"model not found: {self.path}")
        self._config = read_arch_config(self.path)
        self._expected = self._config.weight_shapes()
        self._max_tensors = len(self._expected) + self._config.num_hidden_layers + 1  # ignorable
        self._tensors: dict[str, tuple[Path, TensorInfo]] = {}
        self._files: list[Path] = []
        if not with_weights:
            return
        self._files = _shard_files(self.path, self._max_tensors)
        for file in self._files:
            self._add_file(file)
        missing = sorted(self._expected.keys() - self._tensors.keys())
        if missing:
            raise ModelLoadError(
                f"{self.path}: lacks {len(missing)} of the tensors its config implies, "
                f"e.g. {', '.join(missing[:3])}"
            )

    def _add_file(self, file: Path) -> None:
        """Check one file's tensors against the config (before safetensors opens it);
        keep those the model loads."""
        header = read_safetensors_header(file, self._max_tensors)
        for name, info in header.items():
            if self._ignored(name):
                continue
            if name in self._tensors:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} also in {self._tensors[name][0].name}"
                )
            self._check_tensor(file, name, info)
            self._tensors[name] = (file, info)
        _check_safe_open(file)

    def _ignored(self, name: str) -> bool:
        """Tensors HF checkpoints may hold that the model does not load."""
        if name.endswith(".rotary_emb.inv_freq"):
            return True
        return name == "lm_head.weight" and self._config.tie_word_embeddings

    def _check_tensor(self, file: Path, name: str, info: TensorInfo) -> None:
        shape = self._expected.get(name)
        if shape is None:
            raise ModelLoadError(
                f"{file}: tensor {name!r} has no place in the model its config describes"
            )
        if info.shape != shape:
            raise ModelLoadError(
                f"{file}: tensor {name!r} has shape {info.shape}, but the config implies {shape}"
            )
        mxfp4 = self._config.experts_mxfp4 and name.endswith(MXFP4_SUFFIXES)
        if info.dtype not in WEIGHT_DTYPES and not (mxfp4 and info.dtype == "U8"):
            raise UnsupportedModelError(
                f"{file}: tensor {name!r} is {info.dtype}; weights must be "
                f"{', '.join(WEIGHT_DTYPES)}"
            )

    def tensor_info(self, name: str) -> TensorInfo:
        """Dtype, shape and offsets of one tensor (from the header; no data read)."""
        return self._tensors[name][1]

    def arch_config(self) -> ModelArchConfig:
        return self._config

    def weight_names(self) -> list[str]:
        return list(self._tensors)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self._files:
            names = [name for name, (f, _) in self._tensors.items() if f == file]
            yield from self._iter_file(file, names)

    def _iter_file(self, file: Path, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in names:
                try:
                    tensor = _read_tensor(handle, name)
                except Exception as exc:  # SafetensorError
                    raise ModelLoadError(f"{file}: cannot read tensor {name!r}: {exc}") from None
                yield name, tensor

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        if not any((self.path / name).is_file() for name in TOKENIZER_FILES):
            raise ModelLoadError(f"{self.path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        for name in (*TOKENIZER_FILES, *TOKENIZER_SIDE_FILES):
            file = self.path / name
            if file.is_file() and file.stat().st_size > MAX_TOKENIZER_FILE_BYTES:
                raise ModelLoadError(
                    f"{file}: {file.stat().st_size:,} bytes, more than a tokenizer file may "
                    f"hold ({MAX_TOKENIZER_FILE_BYTES:,})"
                )
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot load the tokenizer: {exc}") from None

    def __repr__(self) -> str:
        return f"HFCheckpoint({str(self.path)!r})"
