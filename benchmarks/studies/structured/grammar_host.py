"""Host cost of structured outputs per decode step: accepting each request's
new token into its xgrammar matcher and filling the next bitmask, for B
requests in a JSON string (the common state), done serially, by xgrammar's
batch matcher, and by a pool of Python threads over shards of the batch.

    python benchmarks/studies/structured/grammar_host.py --tokenizer TOKDIR --batch 1 32 128
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
}


def allowed_tokens(row: np.ndarray, limit: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:limit]
    return np.nonzero(bits)[0]


def run(
    compiled: Any,
    batch: int,
    vocab: int,
    steps: int,
    step_fn: Callable[[list[Any], list[int] | None, np.ndarray], None],
    real_vocab: int,
) -> float:
    import xgrammar as xgr

    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = np.full((batch, (vocab + 31) // 32), -1, dtype=np.int32)
    rng = random.Random(0)
    times = []
    tokens: list[int] | None = None
    for _ in range(steps):
        start = time.perf_counter()
        step_fn(matchers, tokens, bitmask)
        times.append(time.perf_counter() - start)
        tokens = []
        for i in range(batch):
            allowed = allowed_tokens(bitmask[i], real_vocab)
            tokens.append(int(rng.choice(list(allowed))))
    return statistics.median(times[1:]) * 1e3


def main() -> int:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=128256)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=args.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    real_vocab = len(tokenizer)

    def serial(ms: list[Any], tokens: list[int] | None, bm: np.ndarray) -> None:
        if tokens is not None:
            for m, t in zip(ms, tokens, strict=True):
                m.accept_token(t)
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bm, i)

    def batched(threads: int) -> Callable[[list[Any], list[int] | None, np.ndarray], None]:
        batch = xgr.BatchGrammarMatcher(max_threads=threads)

        def step(ms: list[Any], tokens: list[int] | None, bm: np.ndarray) -> None:
            if tokens is not None:
                batch.batch_accept_token(ms, tokens)
            batch.batch_fill_next_token_bitmask(ms, bm)

        return step

    def pooled(threads: int) -> Callable[[list[Any], list[int] | None, np.ndarray], None]:
        pool = ThreadPoolExecutor(threads)

        def shard(ms: list[Any], tokens: list[int] | None, bm: np.ndarray, lo: int) -> None:
            for i, m in enumerate(ms):
                if tokens is not None:
                    m.accept_token(tokens[i])
                m.fill_next_token_bitmask(bm, lo + i)

        def step(ms: list[Any], tokens: list[int] | None, bm: np.ndarray) -> None:
            size = -(-len(ms) // threads)
            futures = [
                pool.submit(
                    shard,
                    ms[lo : lo + size],
                    None if tokens is None else tokens[lo : lo + size],
                    bm,
                    lo,
                )
                for lo in range(0, len(ms), size)
            ]
            for future in futures:
                future.result()

        return step

    for batch in args.batch:
        row = {"serial": run(compiled, batch, args.vocab_size, args.steps, serial, real_vocab)}
        for threads in args.threads:
            row[f"xgr batch {threads}"] = run(
                compiled, batch, args.vocab_size, args.steps, batched(threads), real_vocab
            )
            row[f"pool {threads}"] = run(
                compiled, batch, args.vocab_size, args.steps, pooled(threads), real_vocab
            )
        cells = ", ".join(f"{name} {ms:.3f}" for name, ms in row.items())
        print(f"batch {batch}: accept + fill per step (ms): {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
