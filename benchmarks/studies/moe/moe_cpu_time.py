"""The MoE tiny model's CPU cost per output token, in-process: the engine
(``open_engine``, one rank, float32) serves 16 random prompts of 128
tokens, 64 greedy tokens each, all at once, after a warm-up request; wall
seconds and the process's CPU seconds (every thread, ``getrusage``).
CPU seconds a token move less than wall seconds when other jobs share the
cores, so two trees compare on a busy machine: run it from each tree,
alternated, against one checkpoint (written by ``moe_vs_hf.py``'s
``write_checkpoint`` when ``--checkpoint`` does not exist yet).

    PYTHONPATH=TREE python3 benchmarks/studies/moe/moe_cpu_time.py \\
        --checkpoint /tmp/qwen3-moe-tiny --out RESULT.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import trio

import asyncstep
from asyncstep import SamplingParams


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def serve(
    path: Path,
    prompts: int,
    input_len: int,
    output_len: int,
    budget: int | None = None,
    dtype: str = "float32",
) -> dict[str, float]:
    """The run, the engine in ``dtype``; ``budget`` the step's token budget
    (``max_num_batched_tokens``;
    None: the engine's CPU default, 128 tokens where the CPU has no
    bfloat16; ``asyncstep bench throughput``, so ``moe_vs_hf.py``, gives
    2048: the 16 prompts in one step)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 32768, (prompts, input_len), generator=generator).tolist()
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    options = {} if budget is None else {"max_num_batched_tokens": budget}
    async with asyncstep.open_engine(
        path, device="cpu", dtype=dtype, engine_process=False, **options
    ) as engine:
        await engine.generate(ids[0][:16], SamplingParams(temperature=0, max_tokens=4))
        wall, cpu = time.perf_counter(), cpu_seconds()
        tokens = 0

        async def one(prompt: list[int]) -> None:
            nonlocal tokens
            completion = await engine.generate(prompt, params)
            tokens += len(completion.token_ids)  # (read after the await)

        async with trio.open_nursery() as nursery:
            for prompt in ids:
                nursery.start_soon(one, prompt)
        wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    return {
        "output_tokens": tokens,
        "wall_s": wall,
        "cpu_s": cpu,
        "output_tok_s": tokens / wall,
        "cpu_ms_per_token": 1e3 * cpu / tokens,
        "load_avg": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="2048: moe_vs_hf.py's"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not args.checkpoint.exists():
        sys.path.insert(0, str(Path(__file__).parent))
        from moe_vs_hf import write_checkpoint

        write_checkpoint(args.checkpoint)
    result = trio.run(
        serve,
        args.checkpoint,
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.max_num_batched_tokens,
    )
    result["asyncstep"] = str(Path(asyncstep.__file__).parents[1])
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
