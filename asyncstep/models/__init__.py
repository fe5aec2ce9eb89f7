"""Model definitions with tensor-parallel layers, and their weight loaders.

Holds the Llama family (Llama, Mistral, Qwen2, Qwen3), the layers they are made
of (column/row-parallel linears, vocab-parallel embedding, RMSNorm, rotary,
paged attention), and loaders for GGUF files, HF checkpoint directories and
random ("dummy") weights. May import torch, gguf, safetensors, transformers,
``asyncstep.device``, ``asyncstep.ops`` and the shared ``asyncstep.datatypes``/``errors``.
"""
