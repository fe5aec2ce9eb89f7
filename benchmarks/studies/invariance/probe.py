"""Where the CPU stands on batch invariance (issue 40's first probe): the
embedded model's 4 questions x 32 tokens with ``logprobs=1``, alone against
among 30 other requests, then alone again from the prefix cache, under the
default, a 16-token step budget, no prefix cache, a KV pool that preempts,
overlap on, and n-gram speculation; greedy and seeded (temperature 0.8).
Tokens and log-probs are compared bit for bit.

    python3 benchmarks/studies/invariance/probe.py [--dtype auto] [--weight-packing auto]
"""

from __future__ import annotations

import argparse
from typing import Any

import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, load_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Explain in one sentence why the sky is blue, and mention the name of the effect.",
    "Hi",
]
NEIGHBOURS = [f"Tell me about the number {i} and what it means." * (1 + i % 4) for i in range(30)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, logprobs=1, seed=7)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("default", {}),
    ("chunk16", {"max_num_batched_tokens": 16, "max_num_seqs": 8}),
    ("nocache", {"enable_prefix_caching": False}),
    ("preempt", {"block_size": 16, "num_blocks": 40}),
    ("overlap", {"async_scheduling": True}),
    ("ngram", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
]
Key = tuple[list[int], list[tuple[tuple[int, ...], tuple[float, ...]]]]


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def key(completion: asyncstep.Completion) -> Key:
    logprobs = completion.logprobs or []
    return completion.token_ids, [(tuple(p.token_ids), tuple(p.logprobs)) for p in logprobs]


async def batched(
    engine: asyncstep.Engine, prompts: list[Any], params: SamplingParams
) -> list[Key]:
    out: list[Key] = [([], [])] * len(prompts)

    async def one(i: int) -> None:
        out[i] = key(await engine.generate(prompts[i], params))

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return out


async def run(
    model: LoadedModel, params: SamplingParams, options: dict[str, Any]
) -> tuple[list[Key], list[Key], list[Key]]:
    async with asyncstep.open_engine(model, **options) as engine:
        alone = [key(await engine.generate(chat(q), params)) for q in QUESTIONS]
        crowd = [chat(q) for q in NEIGHBOURS[:15]] + [chat(q) for q in QUESTIONS]
        crowd += [chat(q) for q in NEIGHBOURS[15:]]
        among = (await batched(engine, crowd, params))[15 : 15 + len(QUESTIONS)]
        again = [key(await engine.generate(chat(q), params)) for q in QUESTIONS]
    return alone, among, again


async def main(dtype: str, weight_packing: str) -> None:
    model = load_model(ModelConfig(device="cpu", dtype=dtype, weight_packing=weight_packing))
    print(f"dtype={dtype} weight_packing={weight_packing}")
    for params, name in [(GREEDY, "greedy"), (SEEDED, "seeded")]:
        base: list[Key] | None = None
        for label, options in CASES:
            alone, among, again = await run(model, params, options)
            base = alone if base is None else base
            tokens = [a[0] for a in among] == [a[0] for a in alone]
            same_as_default = [a[0] for a in alone] == [b[0] for b in base]
            print(
                f"{name:7} {label:8} among 30 = alone: tokens {tokens}, log-probs {among == alone}"
                f" | cached = alone: {again == alone} | = the default case's alone: "
                f"tokens {same_as_default}, log-probs {alone == base}",
                flush=True,
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weight-packing", default="auto")
    args = parser.parse_args()
    trio.run(main, args.dtype, args.weight_packing)
