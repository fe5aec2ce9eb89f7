"""Write a tiny gpt-oss's ``config.json`` (transformers' ``GptOssConfig``:
sinks, sliding 128 / full layers alternating, YaRN, 8 experts of which 2
a token) to a directory, for ``asyncstep bench latency --load-format
dummy --model DIR`` (random weights of its shape).

Usage: python benchmarks/studies/sinks/tiny_gpt_oss.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import transformers

#: Attention is a visible share of a step: 8 query heads of 64 over 2 KV heads.
FIELDS = {
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 4096,
}


def main(out: Path) -> None:
    config = transformers.GptOssConfig(**FIELDS)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
