"""The model families asyncstep runs, and what each family's layers are.

An HF ``architectures`` name maps to one family (:data:`ARCHITECTURES`); the
other tables say which families have Gemma's layers, their MLP activations,
which are mixtures of experts with their checkpoints' expert names, and the
routers' scorings and experts' activations a config may name.
:class:`~asyncstep.models.config.ModelArchConfig` reads them, and its
``validate`` refuses a config outside them. Pure data; imports nothing.
"""

from __future__ import annotations

#: HF ``architectures`` names -> our model family.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
}
#: The families whose layers are Gemma's: RMSNorm weights stored as offsets
#: from 1, sandwich norms (``pre_feedforward_layernorm`` /
#: ``post_feedforward_layernorm`` too), embeddings scaled by
#: ``sqrt(hidden_size)``, ``gelu_pytorch_tanh`` gating, a local rotary base
#: for the sliding layers (:mod:`asyncstep.models.gemma3`).
GEMMA_FAMILIES = frozenset({"gemma3"})
#: Each family's MLP activations (HF ``hidden_act`` / ``hidden_activation``).
ACTIVATIONS: dict[str, tuple[str, ...]] = {"gemma3": ("gelu_pytorch_tanh",)}
#: The mixture-of-experts families -> their checkpoints' expert names:
#: (the block's module, gate, up, down projection), e.g.
#: ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` and the router
#: ``model.layers.{i}.mlp.gate.weight``.
MOE_FAMILIES: dict[str, tuple[str, str, str, str]] = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    # gpt-oss: every expert in one tensor per projection
    # (``mlp.experts.gate_up_proj`` [E, H, 2I], gate and up interleaved).
    "gpt_oss": ("mlp", "gate_up_proj", "gate_up_proj", "down_proj"),
}
#: A MoE router's scoring of the experts: softmax or sigmoid of every
#: logit, then the top-k; or (gpt-oss) the top-k logits, then their softmax.
SCORING_FUNCS = ("softmax", "sigmoid", "topk_softmax")
#: The experts' activations (:data:`asyncstep.ops.torch_moe.ACTIVATIONS`).
MOE_ACTIVATIONS = ("silu", "swigluoai")
