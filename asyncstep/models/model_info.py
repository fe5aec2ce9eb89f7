"""What the engine process needs to know of a model without loading its
weights: the architecture (to validate a parallel layout before any rank
starts), the tokenizer, and the context length."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncstep.config import ModelConfig, ParallelConfig
from asyncstep.errors import ConfigError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import SHAPES, get_shape
from asyncstep.models.loader import open_checkpoint
from asyncstep.models.model_loader import maybe_tokenizer, resolve_max_model_len

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncstep.models.loader import Checkpoint


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
    for what, size in (
        ("attention heads", arch.num_attention_heads),
        ("key/value heads", arch.num_key_value_heads),
        ("intermediate size", arch.intermediate_size),
    ):
        if size % tp:
            raise ConfigError(
                f"tensor_parallel_size {tp} does not divide the model's {what} ({size})"
            )
    if pp > arch.num_hidden_layers:
        raise ConfigError(
            f"pipeline_parallel_size {pp} is larger than the layer count ({arch.num_hidden_layers})"
        )
