"""Profile steady decode steps of the engine with torch.profiler (GPU).

Serves a batch of random prompts on dummy weights, then profiles a few
decode steps and prints the ops by device time and by host time.

    python benchmarks/profile_decode.py --shape llama-1b --batch 32
"""

from __future__ import annotations

import argparse
import random

import torch
import trio

import asyncstep
from asyncstep import SamplingParams


async def run(args: argparse.Namespace) -> None:
    async with asyncstep.open_engine(
        args.shape,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.prompt_len + 64,
        max_num_seqs=args.batch,
    ) as engine:
        rng = random.Random(0)
        vocab = engine.arch_config.vocab_size
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)
        ]
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

        async def profiled(prompt: list[int]) -> None:
            """Stream one request: each chunk is one step; profile steps 16-20."""
            prof = torch.profiler.profile(
                activities=[
                    torch.profiler.ProfilerActivity.CPU,
                    torch.profiler.ProfilerActivity.CUDA,
                ]
            )
            count = 0
            async for _chunk in engine.stream(prompt, params):
                count += 1
                if count == 16:
                    prof.start()
                elif count == 21:
                    prof.stop()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(profiled, prompts[0])
            for prompt in prompts[1:]:
                nursery.start_soon(engine.generate, prompt, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    trio.run(run, parser.parse_args())


if __name__ == "__main__":
    main()
