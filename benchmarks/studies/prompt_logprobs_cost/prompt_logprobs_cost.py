"""What a prompt position's log-probs cost against its token (the scheduler's
``PROMPT_LOGPROBS_TOKEN_COST``, in ``asyncstep.engine.core.token_budget``): a
960-token prompt's prefill on the embedded model at the CPU default, with and
without ``prompt_logprobs=20``, the scheduler's cost set to 1 so both compute
the same chunks; median of three
rounds after a warm-up, alternating. Prints the times and the extra a row
costs as a fraction of a token's time.

    python3 benchmarks/studies/prompt_logprobs_cost/prompt_logprobs_cost.py
"""

from __future__ import annotations

import random
import statistics
import time

import trio

import asyncstep
import asyncstep.engine.core.token_budget as token_budget
from asyncstep import SamplingParams

PROMPT_LEN = 960
ROUNDS = 4


async def main() -> None:
    token_budget.PROMPT_LOGPROBS_TOKEN_COST = 1  # the same chunks with and without
    rng = random.Random(0)
    times: dict[str, list[float]] = {"plain": [], "asks": []}
    async with asyncstep.open_engine(engine_process=False, enable_prefix_caching=False) as engine:
        for _ in range(ROUNDS):
            for name, k in (("plain", None), ("asks", 20)):
                prompt = [rng.randrange(3, 49152) for _ in range(PROMPT_LEN)]
                start = time.perf_counter()
                await engine.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=k))
                times[name].append(time.perf_counter() - start)
    plain, asks = (statistics.median(times[n][1:]) for n in ("plain", "asks"))
    print(f"{PROMPT_LEN}-token prompt: plain {plain:.3f} s, prompt_logprobs=20 {asks:.3f} s")
    print(f"a row's log-probs cost {(asks - plain) / plain:.2f} of a token's time")


if __name__ == "__main__":
    trio.run(main)
