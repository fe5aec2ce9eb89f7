"""Random ("dummy") weights: named model shapes, and a synthetic checkpoint
of random tensors for any architecture config. Speed work needs the shape of a
model, not its weights.

The synthetic checkpoint yields whole HF-named tensors, each drawn from a
generator seeded by its name, and goes through the same ``load_weights`` as a
real one: every tensor- and pipeline-parallel layout of the same shape holds
the same weights, so their outputs can be compared.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from asyncstep.errors import ModelLoadError
from asyncstep.models.config import ModelArchConfig

if TYPE_CHECKING:
    import torch

_LLAMA = "LlamaForCausalLM"

SHAPES: dict[str, ModelArchConfig] = {
    "tiny-llama": ModelArchConfig(
        architecture=_LLAMA,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_ids=(2,),
    ),
    "smollm2-135m": ModelArchConfig(
        architecture=_LLAMA,
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_ids=(2,),
    ),
    "llama-1b": ModelArchConfig(
        architecture=_LLAMA,
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        eos_token_ids=(128001,),
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-8b": ModelArchConfig(
        architecture=_LLAMA,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        eos_token_ids=(128001,),
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen3-0.6b": ModelArchConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        qk_norm=True,
        eos_token_ids=(151645,),
    ),
    # Qwen/Qwen3-30B-A3B's config.json: 128 experts, 8 per token, every layer MoE.
    "qwen3-30b-a3b": ModelArchConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        qk_norm=True,
        eos_token_ids=(151645,),
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
    # openai/gpt-oss-20b's config.json (its experts as unquantized tensors:
    # the checkpoint's MXFP4 experts are not read).
    "gpt-oss-20b": ModelArchConfig(
        architecture="GptOssForCausalLM",
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        max_position_embeddings=131072,
        attention_bias=True,
        attention_sinks=True,
        bos_token_id=199998,
        eos_token_ids=(200002,),
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=2880,
        scoring_func="topk_softmax",
        moe_activation="swigluoai",
        sliding_window=128,
        layer_types=("sliding_attention", "full_attention") * 12,
    ),
    # google/gemma-3-1b-it's config.json (its text model): 22 sliding layers
    # of window 512 and 4 full ones (every sixth), 13 KV cache groups.
    "gemma3-1b": ModelArchConfig(
        architecture="Gemma3ForCausalLM",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        bos_token_id=2,
        eos_token_ids=(1, 106),
        sliding_window=512,
        layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 4
        + ("sliding_attention",) * 2,
        query_pre_attn_scalar=256.0,
        rope_local_base_freq=10000.0,
    ),
}


def get_shape(name: str) -> ModelArchConfig:
    try:
        return SHAPES[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown model shape {name!r} for dummy weights; known: {', '.join(SHAPES)}"
        ) from None


def dummy_weight_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """HF names and full shapes of every tensor of a checkpoint of ``arch``
    (:meth:`ModelArchConfig.weight_shapes`)."""
    return arch.weight_shapes()


def dummy_weights(
    arch: ModelArchConfig,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    names: set[str] | None = None,
    scale: float | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Uniform random tensors, the same for a name and seed on every rank;
    ``names`` limits the output to the tensors a rank needs.

    Norm weights are ``1 + U(-1e-3, 1e-3)``; every other tensor is uniform in
    ``[-scale, scale]``, by default ``1 / sqrt(fan_in)`` (``torch.nn.Linear``'s
    own init; fan-in = the last dimension, the hidden size for an embedding
    table). That keeps each projection's gain near one at every model size, so
    the model's output depends on its whole context and layouts can be checked
    against each other by their greedy tokens (a fixed tiny scale makes every
    layer's contribution vanish next to the residual: the next token would be a
    function of the current one alone). MXFP4 experts' blocks and scales
    (gpt-oss) are random uint8 codes and scales of values below 0.5.
    """
    import torch  # here: the shapes above are read by processes without torch

    for name, shape in arch.weight_shapes().items():
        if names is not None and name not in names:
            continue
        generator = torch.Generator(device=device).manual_seed(
            seed * 1_000_003 + zlib.crc32(name.encode())
        )
        if name.endswith(("_blocks", "_scales")):  # MXFP4 experts: codes, scales near 2^-4
            low, high = (0, 256) if name.endswith("_blocks") else (120, 124)
            yield (
                name,
                torch.randint(
                    low, high, shape, generator=generator, dtype=torch.uint8, device=device
                ),
            )
            continue
        norm = name.endswith("norm.weight")
        bound = 1e-3 if norm else scale if scale is not None else shape[-1] ** -0.5
        tensor = torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)
        if norm:
            tensor += 1.0
        yield name, tensor
