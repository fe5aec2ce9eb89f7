"""Profile the host side of decode steps: cProfile inside the rank's launch
thread (where ``execute_model`` and ``sample_tokens`` run), over the steps
after the prefill, for a batch of random prompts on dummy weights.

    python benchmarks/studies/overlap/profile_decode.py --shape llama-1b --batch 32
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
from collections.abc import Callable
from typing import Any

import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.runner.model_runner import ModelRunner


def profiled(
    fn: Callable[..., Any], prof: cProfile.Profile, after_calls: int
) -> Callable[..., Any]:
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls <= after_calls:
            return fn(*args, **kwargs)
        prof.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.disable()

    return wrapper


async def run(args: argparse.Namespace) -> None:
    async with asyncstep.open_engine(
        args.shape,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.prompt_len + 64,
        max_num_seqs=args.batch,
        engine_process=False,  # the runner in this process, where the profiler is
        greedy_in_graph=args.greedy_in_graph,
        batch_invariant=args.batch_invariant,
    ) as engine:
        rng = random.Random(0)
        vocab = engine.arch_config.vocab_size
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)
        ]
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(engine.generate, prompt, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--greedy-in-graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the FULL decode graphs' argmax (issue 43); off: the sampler's",
    )
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="batch_invariant (default: the engine's choice for the device)",
    )
    parser.add_argument(
        "--skip", type=int, help="calls left out first (default: the prefill steps and one more)"
    )
    parser.add_argument("--sort", default="tottime", help="pstats sort key (tottime, cumulative)")
    parser.add_argument("--dump", help="also write the raw profile here (pstats format)")
    args = parser.parse_args()
    prof = cProfile.Profile()
    skip = -(-args.batch * args.prompt_len // 2048) + 2 if args.skip is None else args.skip
    ModelRunner.execute_model = profiled(ModelRunner.execute_model, prof, skip)  # type: ignore[method-assign]
    ModelRunner.sample_tokens = profiled(ModelRunner.sample_tokens, prof, skip)  # type: ignore[method-assign]
    trio.run(run, args)
    if args.dump:
        prof.dump_stats(args.dump)
    pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)


if __name__ == "__main__":
    main()
