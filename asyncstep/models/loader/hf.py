"""HF checkpoint directories: ``config.json`` + ``*.safetensors`` (+ tokenizer files).

Holds :class:`HFCheckpoint`. The config comes from ``config.json`` (eos ids merged
from ``generation_config.json``); weights come from the safetensors files, sharded
(``model.safetensors.index.json``) or not, under their stored (HF) names and dtype.
Every file's header is checked when the checkpoint opens, so a truncated or corrupt
file fails there, naming the file, rather than midway through a load. Pickle
checkpoints (``*.bin``, ``*.pt``) are refused on purpose: loading one runs code.
May import torch, safetensors, transformers and ``asyncstep.models.config``/``errors``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from asyncstep.errors import ModelLoadError
from asyncstep.models.config import ModelArchConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")
#: safetensors refuses headers larger than this; so do we, before reading one.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def read_arch_config(directory: Path) -> ModelArchConfig:
    """``config.json`` as a validated :class:`ModelArchConfig`, eos ids merged from
    ``generation_config.json`` (its ids first) when that file exists."""
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"{directory}: no {CONFIG_FILE} (not an HF checkpoint directory)")
    try:
        config = ModelArchConfig.from_hf_dict(_read_json(config_path))
    except ModelLoadError as exc:
        if str(exc).startswith(str(config_path)):
            raise
        raise type(exc)(f"{config_path}: {exc}") from None
    generation_path = directory / GENERATION_CONFIG_FILE
    if generation_path.is_file():
        generation = _read_json(generation_path)
        eos = _token_ids(generation.get("eos_token_id"))
        merged = eos + tuple(i for i in config.eos_token_ids if i not in eos)
        bos = config.bos_token_id
        if bos is None and _token_ids(generation.get("bos_token_id")):
            bos = _token_ids(generation.get("bos_token_id"))[0]
        config = config.replace(eos_token_ids=merged, bos_token_id=bos)
    return config


def _parse_header_entries(path: Path, header: Mapping[str, Any]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
            info = TensorInfo(str(entry["dtype"]), shape, begin, end)
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(
                f"{path}: corrupt safetensors header: bad entry for {name!r}"
            ) from None
        if not 0 <= begin <= end:
            raise ModelLoadError(f"{path}: corrupt safetensors header: bad offsets for {name!r}")
        tensors[name] = info
    return tensors


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, checked against the file's size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            header_len = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
            if not 0 < header_len <= min(size - 8, MAX_HEADER_BYTES):
                raise ModelLoadError(
                    f"{path}: corrupt or truncated safetensors file: header length "
                    f"{header_len} does not fit a {size:,}-byte file"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header: not a JSON object")
    tensors = _parse_header_entries(path, header)
    needed = 8 + header_len + max((t.end for t in tensors.values()), default=0)
    if needed > size:
        raise ModelLoadError(
            f"{path}: truncated safetensors file: its tensors need {needed:,} bytes "
            f"but the file has {size:,}"
        )
    return tensors


def _check_safe_open(path: Path) -> None:
    """Let safetensors itself vet the header (dtypes, offsets covering the data, ...)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:  # SafetensorError, OSError
        raise ModelLoadError(f"{path}: corrupt safetensors file: {exc}") from None


def _shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else all of them."""
    index_path = directory / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: no weight_map")
        files = [directory / str(name) for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index_path}: names {file.name}, which is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
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
    """An HF checkpoint directory with safetensors weights."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelLoadError(f"model not found: {self.path}")
        self._config = read_arch_config(self.path)
        self._files = _shard_files(self.path)
        self._tensors: dict[str, tuple[Path, TensorInfo]] = {}
        for file in self._files:
            self._add_file(file)

    def _add_file(self, file: Path) -> None:
        header = read_safetensors_header(file)
        _check_safe_open(file)
        for name, info in header.items():
            if name in self._tensors:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} also in {self._tensors[name][0].name}"
                )
            self._tensors[name] = (file, info)

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
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot load the tokenizer: {exc}") from None

    def __repr__(self) -> str:
        return f"HFCheckpoint({str(self.path)!r})"
