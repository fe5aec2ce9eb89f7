"""CPU benchmark: asyncstep against HF transformers ``generate`` on the same
SmolLM2-135M-Instruct weights (the embedded GGUF, dequantized, fp32): 1
request, and 16 concurrent requests of mixed prompt lengths with equal and
with mixed output lengths. Each system runs in a process of its own (one
after the other): two torch thread pools in one process slow both (see
``asyncstep/runner/cpu_threads.py``).

Each workload runs twice per system: generating its output lengths, and
generating 1 token (the prefill). Decode tokens/s = (useful tokens of the long
run - those of the short run) / (time difference); end-to-end tokens/s =
useful tokens / time of the long run. Greedy, EOS ignored. HF's ``generate``
runs the whole batch to its longest output (that is how static batching
works), so with mixed output lengths it computes tokens nobody asked for:
only the requested ones count. Prints a table and the ratios; ``--out`` also
writes them as JSON with the command and the machine.

    python benchmarks/studies/cpu_peers/cpu_vs_hf.py --out benchmarks/results/cpu_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import torch
import trio

import asyncstep
from asyncstep.config import ModelConfig
from asyncstep.models.hf_reference import hf_reference_model
from asyncstep.models.model_info import describe_model


def make_prompts(vocab: int, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_run(model: Any, prompts: list[list[int]], out_lens: list[int]) -> tuple[float, int]:
    """Left-padded batch through ``generate``; returns (seconds, useful tokens)."""
    max_tokens = max(out_lens)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=2,
        )
    elapsed = time.perf_counter() - t0
    assert out.shape[1] - width == max_tokens
    return elapsed, sum(out_lens)


async def ours_run(
    engine: asyncstep.Engine, prompts: list[list[int]], out_lens: list[int]
) -> tuple[float, int]:
    """All requests at once, each with its own output length; (seconds, tokens)."""
    counts: list[int] = []

    async def one(p: list[int], n: int) -> None:
        params = asyncstep.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        counts.append(len((await engine.generate(p, params)).token_ids))

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for p, n in zip(prompts, out_lens, strict=True):
            nursery.start_soon(one, p, n)
    elapsed = time.perf_counter() - t0
    assert sum(counts) == sum(out_lens)
    return elapsed, sum(counts)


def summarize(long: tuple[float, int], short: tuple[float, int]) -> dict[str, float]:
    (t_long, n_long), (t_short, n_short) = long, short
    return {
        "decode_tok_s": (n_long - n_short) / (t_long - t_short),
        "e2e_tok_s": n_long / t_long,
        "seconds": t_long,
        "prefill_seconds": t_short,
    }


def workloads(args: argparse.Namespace, vocab: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    rng = random.Random(1)
    cases: dict[str, tuple[list[list[int]], list[int]]] = {}
    for n in args.concurrency:
        prompts = make_prompts(vocab, n, args.min_prompt, args.max_prompt, seed=n)
        cases[f"{n} x {args.max_tokens} tokens"] = (prompts, [args.max_tokens] * n)
        if n > 1:
            mixed = [rng.randint(args.max_tokens // 4, args.max_tokens) for _ in range(n)]
            cases[f"{n} x {args.max_tokens // 4}-{args.max_tokens} tokens"] = (prompts, mixed)
    return cases


SYSTEMS = ("asyncstep", "hf")


async def bench_side(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One system's best run of every workload (this process runs only it)."""
    vocab = describe_model(ModelConfig()).arch_config.vocab_size
    best: dict[str, dict[str, float]] = {}
    if args.side == "hf":
        reference = hf_reference_model(None, pad_token_id=2)
        hf_run(reference, [[5, 6, 7]], [4])  # warm-up

        async def run(prompts: list[list[int]], out_lens: list[int]) -> tuple[float, int]:
            return hf_run(reference, prompts, out_lens)

        for name, (prompts, out_lens) in workloads(args, vocab).items():
            best[name] = await best_of(args.repeats, run, prompts, out_lens)
        return best
    async with asyncstep.open_engine(dtype="float32", enable_prefix_caching=False) as engine:
        await ours_run(engine, [[5, 6, 7]], [4])  # warm-up

        async def run(prompts: list[list[int]], out_lens: list[int]) -> tuple[float, int]:
            return await ours_run(engine, prompts, out_lens)

        for name, (prompts, out_lens) in workloads(args, vocab).items():
            best[name] = await best_of(args.repeats, run, prompts, out_lens)
    return best


async def best_of(
    repeats: int, run: Any, prompts: list[list[int]], out_lens: list[int]
) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(repeats):
        r = summarize(await run(prompts, out_lens), await run(prompts, [1] * len(prompts)))
        if not best or r["decode_tok_s"] > best["decode_tok_s"]:
            best = r
    return best


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Each system in a subprocess of this script, then the ratios."""
    sides: dict[str, dict[str, dict[str, float]]] = {}
    for side in SYSTEMS:
        cmd = [sys.executable, __file__, "--side", side, "--repeats", str(args.repeats)]
        cmd += ["--concurrency", *map(str, args.concurrency), "--max-tokens", str(args.max_tokens)]
        cmd += ["--min-prompt", str(args.min_prompt), "--max-prompt", str(args.max_prompt)]
        done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
        sides[side] = json.loads(done.stdout.strip().splitlines()[-1])
    results: dict[str, Any] = {}
    vocab = describe_model(ModelConfig()).arch_config.vocab_size
    for name, (prompts, out_lens) in workloads(args, vocab).items():
        ours, hf = sides["asyncstep"][name], sides["hf"][name]
        results[name] = {
            "asyncstep": ours,
            "hf": hf,
            "decode_ratio": ours["decode_tok_s"] / hf["decode_tok_s"],
            "e2e_ratio": ours["e2e_tok_s"] / hf["e2e_tok_s"],
            "prompt_lengths": [len(p) for p in prompts],
            "output_lengths": out_lens,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="best of N")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--side", choices=SYSTEMS, help=argparse.SUPPRESS)  # one system, JSON out
    args = parser.parse_args()
    if args.side:
        print(json.dumps(trio.run(bench_side, args)))
        return
    results = bench(args)
    print(
        f"{'requests':<20} {'ours dec tok/s':>15} {'HF dec tok/s':>13} {'ratio':>6}"
        f" {'ours e2e tok/s':>15} {'HF e2e tok/s':>13} {'ratio':>6}"
    )
    for name, row in results.items():
        ours, hf = row["asyncstep"], row["hf"]
        print(
            f"{name:<20} {ours['decode_tok_s']:15.1f} {hf['decode_tok_s']:13.1f}"
            f" {row['decode_ratio']:6.2f} {ours['e2e_tok_s']:15.1f} {hf['e2e_tok_s']:13.1f}"
            f" {row['e2e_ratio']:6.2f}"
        )
    if args.out:
        record = {
            "command": "python " + " ".join(sys.argv),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.machine()} {platform.processor() or ''} "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}".strip(),
            "results": results,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
