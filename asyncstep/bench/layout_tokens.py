"""Greedy tokens of a PP x TP layout against the single-rank run of the same
weights (issue 6's check: PP = 2 x TP = 2 on four GPUs with NCCL).

    python3 -m asyncstep.bench.layout_tokens --model llama-8b --dtype float32 --tp 2 --pp 2 \\
        --out FILE

``--model`` is a dummy shape name (random weights, the same on every rank and
layout) or a checkpoint (HF directory or GGUF file). The single-rank run uses
one device (``cuda:0`` or the CPU); the layout runs with overlap (async
scheduling) on and off. ``--rank-gpus N`` starts the ranks here on N GPUs
(fewer than the ranks: stages share GPUs, see :mod:`asyncstep.bench.rank_gpus`).

Prints, per request, whether the layout's tokens equal the single rank's (and
where they first differ), and the wall time of each run; exits 1 when any
differs. A check is only as strong as the outputs depend on the inputs, so it
also reports how many distinct tokens the reference produced and whether its
output changes when only the *first* token of the longest prompt does (a
"probe" request: then the tokens depend on attention over the whole context,
KV cache included). ``--out``: ``asyncstep bench``'s results format, a case
per run (``single_rank``, ``overlap_on``, ``overlap_off``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.bench.measurement import engine_opt, record, row_case
from asyncstep.bench.rank_gpus import open_engine_on_gpus
from asyncstep.bench.results import now, write
from asyncstep.models.dummy import SHAPES


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="llama-8b", help="dummy shape name or checkpoint")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--device", help="default: cuda when there is one, else cpu")
    parser.add_argument("--dtype", default="float32", help="float32 keeps reduction order out")
    parser.add_argument("--rank-gpus", type=int, metavar="N", help="start the ranks here on N GPUs")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[3, 17, 64, 200])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument(
        "--engine-opt", type=engine_opt, action="append", default=[], metavar="KEY=VALUE"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def engine_options(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "device": args.device,
        "dtype": args.dtype,
        "max_model_len": max(args.prompt_lens) + args.max_tokens + 16,
        "max_num_batched_tokens": 128,  # long prompts go in chunks
        "gpu_memory_utilization": 0.4,  # stages may share a GPU
        **extra,
    }
    if args.model in SHAPES:
        options["load_format"] = "dummy"
    options.update(dict(args.engine_opt))
    return options


async def generate(
    args: argparse.Namespace, prompts: list[list[int]], **extra: Any
) -> tuple[list[list[int]], float]:
    options = engine_options(args, **extra)
    layout = options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    opened = (
        open_engine_on_gpus(args.model, args.rank_gpus, **options)
        if args.rank_gpus is not None and layout > 1
        else asyncstep.open_engine(args.model, **options)
    )
    async with opened as engine:

        async def one(i: int) -> None:
            tokens[i] = list((await engine.generate(prompts[i], params)).token_ids)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
    return tokens, time.perf_counter() - start


def compare(reference: list[list[int]], got: list[list[int]]) -> list[dict[str, Any]]:
    rows = []
    for i, (ref, out) in enumerate(zip(reference, got, strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), None)
        if first is None and len(ref) != len(out):
            first = min(len(ref), len(out))
        rows.append({"request": i, "equal": ref == out, "first_difference": first})
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    vocab = 1000 if args.model not in SHAPES else SHAPES[args.model].vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in args.prompt_lens]
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    probe = list(prompts[longest])
    probe[0] = probe[0] % (vocab - 1) + 1  # another first token, the rest the same
    prompts.append(probe)
    single_device = "cuda:0" if args.device.startswith("cuda") else args.device
    reference, ref_s = await generate(args, prompts, device=single_device)
    distinct = sorted({t for seq in reference for t in seq})
    context_sensitive = reference[-1] != reference[longest]
    print(
        f"single rank ({single_device}): {ref_s:.1f} s, {len(distinct)} distinct tokens; "
        f"output {'changes' if context_sensitive else 'does NOT change'} with the first "
        "prompt token"
    )
    runs: dict[str, Any] = {}
    layout = {
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "sequence_parallel": args.sequence_parallel,
    }
    for name, overlap in (("overlap_on", True), ("overlap_off", False)):
        tokens, wall = await generate(args, prompts, async_scheduling=overlap, **layout)
        rows = compare(reference, tokens)
        equal = all(r["equal"] for r in rows)
        runs[name] = {"equal": equal, "requests": rows, "wall_s": wall, "tokens": tokens}
        print(
            f"pp {args.pp} x tp {args.tp}, {name}: {wall:.1f} s, "
            f"{'tokens equal' if equal else 'TOKENS DIFFER'} "
            + " ".join(f"[{r['request']}: {r['first_difference']}]" for r in rows if not r["equal"])
        )
    return {
        "model": args.model,
        "dtype": args.dtype,
        "layout": {"tp": args.tp, "pp": args.pp, "rank_gpus": args.rank_gpus, **layout},
        "prompt_lens": args.prompt_lens,
        "max_tokens": args.max_tokens,
        "reference": {
            "tokens": reference,
            "wall_s": ref_s,
            "distinct_tokens": len(distinct),
            "probe": {"of_request": longest, "output_changes": context_sensitive},
        },
        "runs": runs,
        "all_equal": all(r["equal"] for r in runs.values()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = now()
    result = trio.run(run, args)
    rows = [{"run": "single_rank", **result.pop("reference")}]
    rows += [{"run": name, **one} for name, one in result.pop("runs").items()]
    cases = [row_case(row, ["run"]) for row in rows]
    write(
        record("layout_tokens", argv, started, options=vars(args), cases=cases, extra=result),
        args.out,
    )
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
