"""The MoE tiny model on the CPU: asyncstep against HF transformers' generate
(issue 41's CPU target: 16 requests at once >= 3x HF), in one run.

A random-weight Qwen3-MoE of a small model's size (written with
transformers' ``save_pretrained``) serves 16 prompts of 128 random tokens,
64 greedy tokens each (EOS ignored): asyncstep through ``asyncstep bench
throughput`` (a child process, every request at once) and HF through
``generate`` on one static batch of 16 (its own process, the same
threads). Output tokens a second of each, and the ratio. Both in float32
unless ``--dtype`` (ours: ``auto`` is the engine's default, bfloat16 on
CPUs with AVX512-BF16 or AMX) and ``--hf-dtype`` say otherwise.

    python3 benchmarks/studies/moe/moe_vs_hf.py --out RESULT.json \
        [--dtype auto] [--hf-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE: dict[str, Any] = dict(
    vocab_size=32768,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)


def write_checkpoint(path: Path) -> int:
    """The random Qwen3-MoE at ``path``; its parameter count."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE))
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def hf_generate(
    path: Path, prompts: int, input_len: int, output_len: int, dtype: str = "float32"
) -> dict[str, float]:
    """HF's generate on one batch of ``prompts`` random prompts (a warm-up
    of 4 tokens first): output tokens a second."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.eval()
    ids = torch.randint(1, SHAPE["vocab_size"], (prompts, input_len), generator=torch.Generator())
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - input_len) * prompts
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds}


def ours(
    path: Path, prompts: int, input_len: int, output_len: int, out: Path, dtype: str = "float32"
) -> dict[str, Any]:
    """``asyncstep bench throughput`` on the checkpoint (its JSON)."""
    command = [
        sys.executable, "-m", "asyncstep", "bench", "throughput", "--model", str(path),
        "--num-prompts", str(prompts), "--input-len", str(input_len),
        "--output-len", str(output_len), "--no-floor", "--no-gpu-busy",
        "--dtype", dtype, "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True)
    return dict(json.loads(out.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dtype", default="float32", help="ours (auto: the engine's default)")
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qwen3-moe-tiny"
        params = write_checkpoint(path)
        work = (path, args.num_prompts, args.input_len, args.output_len)
        result = ours(*work, Path(tmp) / "o.json", args.dtype)
        hf = hf_generate(*work, args.hf_dtype)
    mine = _output_tok_s(result)
    report = {
        "shape": SHAPE,
        "parameters": params,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
        "hf_dtype": args.hf_dtype,
        "asyncstep_output_tok_s": mine,
        "hf_output_tok_s": hf["output_tok_s"],
        "ratio": mine / hf["output_tok_s"],
        "hf": hf,
        "asyncstep": result,
        "uptime": os.getloadavg(),
    }
    print(
        f"{params / 1e6:.0f}M parameters, {args.num_prompts} x {args.input_len} -> "
        f"{args.output_len}: asyncstep ({args.dtype}) {mine:.1f} out tok/s, HF generate "
        f"({args.hf_dtype}) {hf['output_tok_s']:.1f}, ratio {report['ratio']:.2f}"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1, default=str))


def _output_tok_s(result: Any) -> float:
    """The first ``output_tok_s`` of ``asyncstep bench throughput``'s JSON
    (its ``figures``)."""
    if isinstance(result, dict):
        if "output_tok_s" in result:
            return float(result["output_tok_s"])
        values = list(result.values())
    elif isinstance(result, list):
        values = result
    else:
        raise KeyError("output_tok_s")
    for value in values:
        try:
            return _output_tok_s(value)
        except KeyError:
            continue
    raise KeyError("output_tok_s")


if __name__ == "__main__":
    main()
