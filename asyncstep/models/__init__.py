"""Model definitions with tensor-parallel layers, and their weight loaders.

Holds the Llama family (Llama, Mistral, Qwen2, Qwen3), the mixture-of-experts
families built on it (Qwen3-MoE, Mixtral, OLMoE: :mod:`asyncstep.models.moe`),
the layers they are made of (column/row-parallel and replicated linears,
vocab-parallel embedding, RMSNorm, rotary, paged attention, MoE router and
experts), which class runs which family (:mod:`asyncstep.models.registry`),
and loaders for GGUF files, HF checkpoint directories and
random ("dummy") weights. May import torch, gguf, safetensors, transformers,
``asyncstep.device``, ``asyncstep.ops`` and the shared ``asyncstep.datatypes``/``errors``.
"""
