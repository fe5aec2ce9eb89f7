"""What the engine process needs to know of a model without loading its
weights: the architecture (to validate a parallel layout before any rank
starts), the tokenizer, the context length and the device type.

Imports no torch (a front end describes the model while the engine-core
process, which needs torch, starts): may import ``asyncstep.config``,
``errors``, ``logging`` and the torch-free parts of ``asyncstep.models``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncstep.config import ModelConfig, ParallelConfig
from asyncstep.errors import ConfigError, ModelLoadError
from asyncstep.logging import get_logger
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import SHAPES, get_shape
from asyncstep.models.loader import open_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncstep.models.loader import Checkpoint

log = get_logger("models")


@dataclass(frozen=True)
class ModelInfo:
    arch_config: ModelArchConfig
    tokenizer: PreTrainedTokenizerBase | None
    max_model_len: int
    #: The checkpoint's path, or a shape name for dummy weights.
    source: str


def model_arch(config: ModelConfig) -> tuple[ModelArchConfig, Checkpoint | None]:
    """The architecture of ``config``'s model, and its checkpoint opened (None
    for a dummy shape): the part of :func:`describe_model` a layout check needs."""
    if config.load_format == "dummy" and (config.model is None or str(config.model) in SHAPES):
        return get_shape(str(config.model or "smollm2-135m")), None
    if config.load_format == "dummy" and not Path(str(config.model)).exists():
        get_shape(str(config.model))  # neither a shape nor a path: the known shapes, listed
    checkpoint = open_checkpoint(config.model, config.load_format)
    return checkpoint.arch_config(), checkpoint


def describe_model(
    config: ModelConfig, opened: tuple[ModelArchConfig, Checkpoint | None] | None = None
) -> ModelInfo:
    """Architecture, tokenizer and context of ``config``'s model (no weights
    read); ``opened``: :func:`model_arch`'s result, when the caller has it."""
    arch, checkpoint = model_arch(config) if opened is None else opened
    max_model_len = resolve_max_model_len(config.max_model_len, arch)
    if checkpoint is None:
        return ModelInfo(arch, None, max_model_len, str(config.model or "smollm2-135m"))
    return ModelInfo(arch, maybe_tokenizer(checkpoint), max_model_len, str(checkpoint.path))


def validate_parallel_layout(arch: ModelArchConfig, parallel: ParallelConfig) -> None:
    """Refuse a layout that cannot work, before any rank starts."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    validate_expert_parallel(arch, parallel)
    sizes = [
        ("attention heads", arch.num_attention_heads),
        ("key/value heads", arch.num_key_value_heads),
        ("intermediate size", arch.intermediate_size),
    ]
    if not parallel.enable_expert_parallel:  # under EP the experts stay whole
        sizes.append(("expert intermediate size", arch.moe_intermediate_size))
    for what, size in sizes:
        if size % tp:
            raise ConfigError(
                f"tensor_parallel_size {tp} does not divide the model's {what} ({size})"
            )
    if pp > arch.num_hidden_layers:
        raise ConfigError(
            f"pipeline_parallel_size {pp} is larger than the layer count ({arch.num_hidden_layers})"
        )


def validate_expert_parallel(arch: ModelArchConfig, parallel: ParallelConfig) -> None:
    """Refuse ``enable_expert_parallel`` for a dense model, for gpt-oss (not
    yet), or where the TP size (the EP size) does not divide the experts;
    with one TP rank it is a no-op."""
    if not parallel.enable_expert_parallel:
        return
    if not arch.is_moe:
        raise ConfigError(
            f"enable_expert_parallel needs a mixture-of-experts model; "
            f"{arch.architecture} has no experts"
        )
    if arch.family == "gpt_oss":  # its stacked, biased experts load for TP only
        raise ConfigError("enable_expert_parallel: gpt-oss runs its experts split by TP only")
    ep = parallel.tensor_parallel_size
    if arch.num_experts % ep:
        raise ConfigError(
            f"enable_expert_parallel: tensor_parallel_size {ep} (the EP size) does not "
            f"divide the model's {arch.num_experts} experts"
        )


def device_type(name: str) -> str:
    """The type (``"cpu"``, ``"cuda"``) of the device ``name`` (validated by
    :class:`ModelConfig`) resolves to, unchecked (``resolve_device`` checks);
    ``auto``: cuda when torch sees a device. A torch built without CUDA or
    ROCm answers ``cpu`` without being imported."""
    if name != "auto":
        return name.partition(":")[0]
    if "torch" not in sys.modules and not _torch_has_gpu_build():
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _torch_has_gpu_build() -> bool:
    """Whether the installed torch was built for CUDA or ROCm, read from its
    ``version.py`` (``cuda = None`` and ``hip = None`` in a CPU build); True
    where that cannot be told."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return True
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return True
    none = (r"^cuda\b[^=\n]*=\s*None\s*$", r"^hip\b[^=\n]*=\s*None\s*$")
    return not all(re.search(each, text, re.MULTILINE) for each in none)


def resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    if requested is None:
        return arch.max_position_embeddings
    if requested > arch.max_position_embeddings:
        raise ConfigError(
            f"max_model_len {requested} is longer than the model's context "
            f"({arch.max_position_embeddings})"
        )
    return requested


def maybe_tokenizer(checkpoint: Checkpoint) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer; without one, prompts must be token ids."""
    try:
        return checkpoint.load_tokenizer()
    except ModelLoadError as exc:
        log.warning("no tokenizer: prompts must be token ids", reason=str(exc))
        return None
