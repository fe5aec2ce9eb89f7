"""The blocking API against the async one, in one run (issue 38's target:
``LLM.generate`` on 256 prompts in one call within 5 % of the async API's
tokens/s).

Both sides serve the same workload on an engine of the same configuration
(the engine flags are ``asyncstep generate``'s; the embedded model unless
told otherwise): ``--num-prompts`` random prompts of ``--input-len`` token
ids, ``--output-len`` tokens each (greedy, EOS ignored). The async side
opens the engine with ``open_engine`` on this thread's Trio loop and sends
every prompt at once (``engine.generate`` in a nursery); the blocking side
opens ``asyncstep.LLM`` and makes one ``llm.generate(prompts, params)``
call. Each round opens one side's engine, warms it with a request, times
the whole batch, then closes it before the other side's (one engine at a
time: the device's memory is each one's); the sides alternate which goes
first. Reported: each side's output tokens/s per round and median, and the
ratio blocking / async of the medians (the target: >= 0.95). ``--out``
writes them as JSON::

    python benchmarks/studies/host/blocking_api.py --out benchmarks/results/blocking_api.json
    python benchmarks/studies/host/blocking_api.py --model tiny-llama --load-format dummy \\
        --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

import asyncstep
from asyncstep.bench.results import machine_info, now
from asyncstep.bench.workload import random_prompts
from asyncstep.cli import add_engine_flags, config_from_args
from asyncstep.config import EngineConfig
from asyncstep.models.model_info import model_arch

SIDES = ("async", "blocking")


def run_async(
    config: EngineConfig, prompts: list[list[int]], params: asyncstep.SamplingParams
) -> dict[str, float]:
    """Every prompt sent at once to an engine on this thread's Trio loop
    (after a warm-up request): :func:`figures`."""

    async def main() -> dict[str, float]:
        async with asyncstep.open_engine(config=config) as engine:
            await engine.generate(prompts[0], params)  # warm-up
            outs: list[asyncstep.Completion] = []

            async def one(prompt: list[int]) -> None:
                outs.append(await engine.generate(prompt, params))

            steps = engine.statistics().num_steps
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(one, prompt)
            wall = time.perf_counter() - start
            return figures(wall, outs, engine.statistics().num_steps - steps)

    return trio.run(main)


def run_blocking(
    config: EngineConfig, prompts: list[list[int]], params: asyncstep.SamplingParams, bar: bool
) -> dict[str, float]:
    """One ``LLM.generate`` call of every prompt (after a warm-up request):
    :func:`figures`."""
    with asyncstep.LLM(config=config) as llm:
        llm.generate(prompts[0], params, progress=False)  # warm-up
        steps = llm.statistics().num_steps
        start = time.perf_counter()
        outs = llm.generate(prompts, params, progress=bar)
        wall = time.perf_counter() - start
        return figures(wall, outs, llm.statistics().num_steps - steps)


def figures(wall: float, outs: list[asyncstep.Completion], steps: int) -> dict[str, float]:
    """A side's round: its wall time, output tokens, tokens/s and engine steps."""
    tokens = sum(len(out.token_ids) for out in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "steps": steps}


def measure(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    arch, _ = model_arch(config.model)
    prompts = random_prompts(arch.vocab_size, [args.input_len] * args.num_prompts, args.seed)
    params = asyncstep.SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for round_index in range(args.repeats):
        order = SIDES if round_index % 2 == 0 else SIDES[::-1]
        for side in order:
            if side == "async":
                got = run_async(config, prompts, params)
            else:
                got = run_blocking(config, prompts, params, args.progress)
            rounds[side].append(got)
            print(
                f"round {round_index + 1} {side:>8}: {got['tok_s']:10.1f} tok/s "
                f"({got['wall_s']:.2f} s, {got['steps']:.0f} steps)"
            )
    medians = {side: statistics.median(r["tok_s"] for r in rounds[side]) for side in SIDES}
    return {
        "rounds": rounds,
        "median_tok_s": medians,
        "ratio_blocking_over_async": medians["blocking"] / medians["async"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each side once a round)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="LLM.generate without its progress bar (shown only on a terminal)",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    parser.add_argument("--log-json", default=None)
    add_engine_flags(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    figures = measure(args, config)
    medians = figures["median_tok_s"]
    print(
        f"median: async {medians['async']:.1f} tok/s, blocking {medians['blocking']:.1f} tok/s; "
        f"blocking / async = {figures['ratio_blocking_over_async']:.3f} (target >= 0.95)"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "command": "python " + " ".join(sys.argv),
            "date": now(),
            "machine": msgspec.to_builtins(machine_info()),
            "engine": msgspec.to_builtins(config),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            **figures,
        }
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
