"""The benchmarks' random workloads: prompts of random token ids (ids from
3 up: clear of the usual special tokens), lengths fixed, spread within a
ratio (vLLM's random dataset) or uniform in a range, seeded; optionally
each behind one of a few shared prefixes (system prompts: vLLM's
``prefix_repetition`` dataset)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

#: The lowest token id of a random prompt.
FIRST_ID = 3


def random_prompts(vocab_size: int, lengths: Sequence[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab_size) for _ in range(n)] for n in lengths]


def lengths(
    rng: random.Random,
    count: int,
    mean: int | None,
    range_ratio: float,
    uniform: tuple[int, int],
) -> list[int]:
    """``count`` lengths: uniform within ``range_ratio`` of ``mean``, or,
    with no mean, uniform in ``uniform`` (inclusive)."""
    if mean is None:
        return [rng.randint(*uniform) for _ in range(count)]
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    #: Seconds after the start at which the request is sent.
    arrival_s: float = 0.0


def workload(
    vocab_size: int,
    count: int,
    input_len: int | None,
    output_len: int | None,
    *,
    range_ratio: float = 0.0,
    uniform: tuple[int, int] = (1, 1),
    request_rate: float = math.inf,
    seed: int = 0,
    prefix_len: int = 0,
    num_prefixes: int = 1,
) -> list[Request]:
    """``count`` requests of random prompts; input and output lengths as
    :func:`lengths`; arrivals a Poisson process of ``request_rate`` per
    second (inf: all at 0). ``prefix_len`` > 0: each prompt is one of
    ``num_prefixes`` random prefixes of that many tokens (drawn at random
    per request) followed by its own random tokens (the input length)."""
    if prefix_len < 0 or num_prefixes < 1:
        raise ValueError(f"prefix_len >= 0 and num_prefixes >= 1, got {prefix_len}, {num_prefixes}")
    rng = random.Random(seed)
    ins = lengths(rng, count, input_len, range_ratio, uniform)
    outs = lengths(rng, count, output_len, range_ratio, uniform)
    prompts = random_prompts(vocab_size, ins, seed + 1)
    if prefix_len:
        prefixes = random_prompts(vocab_size, [prefix_len] * num_prefixes, seed + 2)
        prompts = [prefixes[rng.randrange(num_prefixes)] + p for p in prompts]
    requests, at = [], 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        requests.append(Request(prompt, out, at))
        if math.isfinite(request_rate):
            at += rng.expovariate(request_rate)
    return requests
