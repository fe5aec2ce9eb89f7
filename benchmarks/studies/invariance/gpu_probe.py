"""Batch invariance on the GPU (issue 40): 8 prompts (token ids, random
weights of a shape) with ``logprobs=1``, greedy, each alone against among 32
other requests of other lengths, then alone again (its prefix from the
cache); with ``batch_invariant`` off and on, each without and with n-gram
speculation (3 tokens). Tokens and log-probs are compared bit for bit; one
line per case, then whether speculation gave plain decoding's tokens and
log-probs. The prompts repeat a pattern (the n-gram drafter finds matches)
and their lengths pass the attention's 256-key splits.

    python3 benchmarks/studies/invariance/gpu_probe.py --model llama-1b
    python3 benchmarks/studies/invariance/gpu_probe.py --model tiny-llama --device cpu \\
        --max-tokens 8 --crowd 6   # a dry run on the CPU
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, load_model

Key = tuple[list[int], list[tuple[tuple[int, ...], tuple[float, ...]]]]
NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}


def prompts(count: int, vocab: int, seed: int, lengths: list[int]) -> list[list[int]]:
    """``count`` prompts of a repeated 12-token pattern and random ids."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        pattern = [rng.randrange(3, vocab) for _ in range(12)]
        length = lengths[i % len(lengths)]
        ids = (pattern * (length // 24 + 1))[: length // 2]
        out.append(ids + [rng.randrange(3, vocab) for _ in range(length - len(ids))])
    return out


def key(completion: asyncstep.Completion) -> Key:
    logprobs = completion.logprobs or []
    return completion.token_ids, [(tuple(p.token_ids), tuple(p.logprobs)) for p in logprobs]


async def batched(
    engine: asyncstep.Engine, batch: list[list[int]], params: SamplingParams
) -> list[Key]:
    out: list[Key] = [([], [])] * len(batch)

    async def one(i: int) -> None:
        out[i] = key(await engine.generate(batch[i], params))

    async with trio.open_nursery() as nursery:
        for i in range(len(batch)):
            nursery.start_soon(one, i)
    return out


async def run(
    model: LoadedModel,
    mine: list[list[int]],
    crowd: list[list[int]],
    params: SamplingParams,
    options: dict[str, Any],
) -> tuple[list[Key], list[Key], list[Key]]:
    """``mine`` alone (one after another), among ``crowd``, alone again."""
    async with asyncstep.open_engine(model, **options) as engine:
        alone = [key(await engine.generate(p, params)) for p in mine]
        half = len(crowd) // 2
        together = crowd[:half] + mine + crowd[half:]
        among = (await batched(engine, together, params))[half : half + len(mine)]
        again = [key(await engine.generate(p, params)) for p in mine]
    return alone, among, again


async def main(args: argparse.Namespace) -> None:
    config = ModelConfig(
        model=args.model,
        load_format="dummy",
        device=args.device,
        max_model_len=args.max_model_len,
    )
    model = load_model(config, with_tokenizer=False)
    vocab = model.arch_config.vocab_size
    mine = prompts(args.prompts, vocab, 1, [40, 300, 90, 600, 17, 260, 130, 512])
    crowd = prompts(args.crowd, vocab, 2, [700, 64, 250, 33, 1000, 180, 3, 420])
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=1
    )
    base: dict[str, Any] = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.crowd + args.prompts,
        "cudagraph_capture_sizes": args.capture_sizes,
    }
    print(f"model={args.model} device={args.device} prompts={args.prompts} crowd={args.crowd}")
    for invariant in (False, True):
        plain: list[Key] = []
        for spec in (False, True):
            options = {**base, "batch_invariant": invariant, **(NGRAM if spec else {})}
            alone, among, again = await run(model, mine, crowd, params, options)
            tokens = [a[0] for a in among] == [a[0] for a in alone]
            same = sum(a == b for a, b in zip(among, alone, strict=True))
            print(
                f"batch_invariant={invariant!s:5} ngram={spec!s:5} among {args.crowd} = alone: "
                f"tokens {tokens}, log-probs {among == alone} ({same}/{len(mine)} prompts) | "
                f"cached = alone: {again == alone}",
                flush=True,
            )
            if not spec:
                plain = alone
            else:
                spec_tokens = [a[0] for a in alone] == [p[0] for p in plain]
                print(
                    f"batch_invariant={invariant!s:5} ngram = plain (alone): tokens "
                    f"{spec_tokens}, log-probs {alone == plain}",
                    flush=True,
                )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-1b", help="a dummy shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--crowd", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--capture-sizes",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8, 16, 32, 64],
        help="CUDA-graph sizes (few: four engines start)",
    )
    trio.run(main, parser.parse_args())
