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


@dataclass(frozen=True)
class ModelInfo:
    arch_config: ModelArchConfig
    tokenizer: PreTrainedTokenizerBase | None
    max_model_len: int
    #: The checkpoint's path, or a shape name for dummy weights.
    source: str


def describe_model(config: ModelConfig) -> ModelInfo:
    """Architecture, tokenizer and context of ``config``'s model (no weights read)."""
    if config.load_format == "dummy" and (config.model is None or str(config.model) in SHAPES):
        name = str(config.model or "smollm2-135m")
        arch = get_shape(name)
        return ModelInfo(arch, None, resolve_max_model_len(config.max_model_len, arch), name)
    checkpoint = open_checkpoint(config.model, config.load_format)
    arch = checkpoint.arch_config()
    return ModelInfo(
        arch,
        maybe_tokenizer(checkpoint),
        resolve_max_model_len(config.max_model_len, arch),
        str(checkpoint.path),
    )


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
