"""CPU step time against the step's token budget (``max_num_batched_tokens``),
for the embedded SmolLM2-135M-Instruct (its default dtype): what the CPU's default budget
(``asyncstep.config.CPU_MAX_NUM_BATCHED_TOKENS``) is picked from.

For each budget, one in-process engine on the loaded model (prefix caching
off) computes one prompt of each ``--prompt-len`` (random token ids, seeded),
``max_tokens=1``: chunked prefill splits it into steps of the budget. Each
step's runner calls (``execute_model`` and ``sample_tokens``, on the rank's
launch thread: on the CPU that is the forward itself) are timed on the wall
clock and on that thread's CPU clock. The CPU time is what the step costs
on a machine to itself: other processes sharing the cores inflate the wall
time, not it. The torch threads are the engine's default (``cpu_threads``).
A step's cost grows with its tokens and with its context (the
prefix a chunk attends to): the worst step of a budget is its last chunk
of the longest prompt.

Prints per budget: steps, the worst step (CPU and wall seconds), the worst
step whose chunk ends within ``--pick-context`` tokens of context, the mean
CPU milliseconds per token; then the largest budget whose worst step within
that context takes at most ``--target-s`` of CPU (a step past it, deep in a
long context, costs more whatever the budget: its chunk attends to the whole
prefix). ``--out`` writes every step as JSON. The default run (about 10
minutes on 2 quiet cores)::

    python benchmarks/studies/cpu_step_budget/cpu_step_budget.py \\
        --out benchmarks/results/cpu_step_budget.json
"""

from __future__ import annotations

import argparse
import os
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
from asyncstep.bench.study import write_results
from asyncstep.config import ModelConfig, ParallelConfig
from asyncstep.datatypes import SchedulerOutput
from asyncstep.models.model_loader import LoadedModel, cpu_threads, load_model
from asyncstep.runner.model_runner import ModelRunner


class StepClock:
    """Wraps :class:`ModelRunner`'s step calls: each step's tokens, wall and
    thread-CPU seconds (execute_model + sample_tokens)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self._execute = ModelRunner.execute_model
        self._sample = ModelRunner.sample_tokens

    def __enter__(self) -> StepClock:
        clock = self

        def execute_model(runner: ModelRunner, so: SchedulerOutput, *args: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return clock._execute(runner, so, *args)
            finally:
                clock.steps.append(
                    {
                        "tokens": so.total_num_scheduled_tokens,
                        "wall_s": time.perf_counter() - wall,
                        "cpu_s": time.thread_time() - cpu,
                    }
                )

        def sample_tokens(runner: ModelRunner, *args: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return clock._sample(runner, *args)
            finally:
                if clock.steps:
                    clock.steps[-1]["wall_s"] += time.perf_counter() - wall
                    clock.steps[-1]["cpu_s"] += time.thread_time() - cpu

        ModelRunner.execute_model = execute_model  # type: ignore[method-assign]
        ModelRunner.sample_tokens = sample_tokens  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        ModelRunner.execute_model = self._execute  # type: ignore[method-assign]
        ModelRunner.sample_tokens = self._sample  # type: ignore[method-assign]


async def time_budget(
    loaded: LoadedModel, budget: int, prompts: Sequence[list[int]]
) -> list[dict[str, Any]]:
    """Every step of ``prompts`` (one at a time) under ``budget``."""
    max_len = max(len(p) for p in prompts) + 1
    async with asyncstep.open_engine(
        loaded,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        max_model_len=max_len,
        num_blocks=-(-max_len // 16) + 1,
    ) as engine:
        await engine.generate(prompts[0][:8], SamplingParams(max_tokens=2))  # warm-up
        rows = []
        for prompt in prompts:
            with StepClock() as clock:
                await engine.generate(prompt, SamplingParams(max_tokens=1))
            context = 0
            for step in clock.steps:
                context += step["tokens"]  # the prompt's tokens computed by the step's end
                rows.append(
                    {"budget": budget, "prompt_len": len(prompt), "context": context, **step}
                )
        return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[2048, 8191])
    parser.add_argument(
        "--target-s",
        type=float,
        default=0.6,
        help="most CPU seconds of a step (well within the 1 s a stream's next token may wait: "
        "the API server and a busy machine take their share)",
    )
    parser.add_argument(
        "--pick-context",
        type=int,
        default=2048,
        help="the pick counts the steps whose chunk ends within this many tokens of context",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=cpu_threads(ParallelConfig()),
        help="torch threads (default: the engine's cpu_threads default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(ModelConfig(device="cpu"))
    rng = random.Random(args.seed)
    vocab = loaded.arch_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in args.prompt_len]
    rows: list[dict[str, Any]] = []
    summary: dict[int, dict[str, float]] = {}
    near = args.pick_context
    print(
        f"{'budget':>6} {'steps':>5} {'worst cpu s':>11} {'worst wall s':>12} "
        f"{f'<= {near}: cpu s':>15} {'cpu ms/tok':>10}"
    )
    for budget in args.budgets:
        steps = trio.run(time_budget, loaded, budget, prompts)
        per_token = sum(s["cpu_s"] for s in steps) / sum(s["tokens"] for s in steps)
        summary[budget] = {
            "worst_cpu_s": max(s["cpu_s"] for s in steps),
            "worst_wall_s": max(s["wall_s"] for s in steps),
            "worst_cpu_s_near": max(s["cpu_s"] for s in steps if s["context"] <= near),
            "cpu_ms_per_token": per_token * 1e3,
        }
        rows += steps
        figures = summary[budget]
        print(
            f"{budget:>6} {len(steps):>5} {figures['worst_cpu_s']:>11.3f} "
            f"{figures['worst_wall_s']:>12.3f} {figures['worst_cpu_s_near']:>15.3f} "
            f"{per_token * 1e3:>10.2f}",
            flush=True,
        )
    fits = [b for b, s in summary.items() if s["worst_cpu_s_near"] <= args.target_s]
    pick = max(fits) if fits else None
    print(
        f"largest budget whose every step within {near} tokens of context takes at most "
        f"{args.target_s} s of CPU: {pick}"
    )
    if args.out is not None:
        write_results(
            args.out,
            rows,
            threads=args.threads,
            target_s=args.target_s,
            pick_context=near,
            summary=summary,
            pick=pick,
            load_avg=os.getloadavg(),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
