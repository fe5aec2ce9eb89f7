"""N-gram speculation's acceptance rate for seeded requests (issue 40):
the embedded model, a repetitive prompt, 16 requests x 96 tokens at
temperature 0.8, each with a seed of its own, n-gram drafts (3 tokens,
lookups of 2 to 5 tokens); the drafts proposed and accepted, and whether
each request's samples equal a plain engine's (no speculation).

    python3 benchmarks/studies/invariance/seeded_acceptance.py
"""

from __future__ import annotations

from typing import Any

import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import load_model

PROMPT = [
    {
        "role": "user",
        "content": "Write the list 'red, green, blue, yellow, red, green, blue, yellow' "
        "ten times, one list per line.",
    }
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
REQUESTS = 16


def params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.8, max_tokens=96, ignore_eos=True, seed=seed)


async def samples(engine: asyncstep.Engine) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(REQUESTS)]

    async def one(i: int) -> None:
        out[i] = (await engine.generate(PROMPT, params(i))).token_ids

    async with trio.open_nursery() as nursery:
        for i in range(REQUESTS):
            nursery.start_soon(one, i)
    return out


async def main() -> None:
    model = load_model(ModelConfig(device="cpu"))
    async with asyncstep.open_engine(model) as engine:
        plain = await samples(engine)
    options: dict[str, Any] = {"speculative_config": NGRAM}
    async with asyncstep.open_engine(model, **options) as engine:
        speculated = await samples(engine)
        stats = engine.statistics()
    same = sum(a == b for a, b in zip(plain, speculated, strict=True))
    print(
        f"drafts {stats.spec_decode_num_drafts}, draft tokens {stats.spec_decode_num_draft_tokens},"
        f" accepted {stats.spec_decode_num_accepted_tokens}"
        f" (rate {stats.spec_decode_acceptance_rate:.3f}),"
        f" per position {list(stats.spec_decode_num_accepted_tokens_per_pos)};"
        f" requests with plain decoding's samples: {same} of {REQUESTS}"
    )


if __name__ == "__main__":
    trio.run(main)
