"""Speculative decoding (n-gram prompt lookup) at batch 1: asyncstep with
and without ``speculative_config``, on prompts that repeat their context
(rewrite / copy / correct a given paragraph) and on prompts that do not,
from ``benchmarks/studies/spec_decode/prompts/spec_decode.json``.

Both engines are open at once (two engine-core processes, on the same
model and options) and serve one request at a time, alternating prompt by
prompt (without speculation, then with), so a slow stretch of a shared
machine falls on both. Per category (chat template applied, greedy,
``max_tokens``, EOS honoured): the decode tokens/s of each (the tokens
after each request's first over the time from its first token to its
last: speculation does not change a prefill) and end to end (every token
over the whole request, prefill included), their ratios (with / without;
targets: >= 1.5 on repetitive prompts, >= 0.97 on the others), the
acceptance rate and how many outputs were token for token the same (bf16
and packed weights may tip a near tie differently in a verify step, so
this is reported, not asserted). The load
average before and after is printed with the figures (``uptime``).

    # embedded SmolLM2, k = 4:
    python benchmarks/studies/spec_decode/spec_decode.py
    python benchmarks/studies/spec_decode/spec_decode.py --max-tokens 64 --rounds 1 \\
        --out result.json
    # a draft model: the first 26 layers of the GGUF:
    python benchmarks/studies/spec_decode/spec_decode.py --draft-layers 26 --k 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

import asyncstep
from asyncstep import SamplingParams

PROMPTS = Path(__file__).with_name("prompts") / "spec_decode.json"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def one_request(
    engine: asyncstep.Engine, prompt: str, max_tokens: int
) -> tuple[float, float, list[int]]:
    """One greedy chat request, alone on the engine: (seconds from its first
    token to its last, seconds in all, its token ids)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids: list[int] = []
    t0 = time.perf_counter()
    first = None
    async for chunk in engine.stream([{"role": "user", "content": prompt}], params):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        ids += chunk.token_ids
    end = time.perf_counter()
    return end - (first or end), end - t0, ids


def truncated_draft(model: str | None, num_layers: int) -> Path:
    """The first ``num_layers`` layers of the GGUF ``model`` (None: the
    embedded one), written once under ``~/.cache/asyncstep/drafts``."""
    from asyncstep.models.loader import default_model_path
    from asyncstep.models.loader.gguf_truncate import write_truncated_gguf

    source = Path(model) if model else default_model_path()
    path = Path.home() / ".cache/asyncstep/drafts" / f"{source.stem}.layers{num_layers}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_truncated_gguf(source, path, num_layers)
    return path


async def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts: dict[str, list[str]] = json.loads(PROMPTS.read_text())
    spec: dict[str, Any] = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.lookup_min,
        "prompt_lookup_max": args.lookup_max,
    }
    if args.draft or args.draft_layers:
        spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
        if args.draft_layers:
            spec["model"] = str(truncated_draft(args.model, args.draft_layers))
    options: dict[str, Any] = {}
    if args.model:
        options["model"] = args.model
    if args.cpu_threads:
        options["cpu_threads"] = args.cpu_threads
    results: dict[str, Any] = {}
    async with (
        asyncstep.open_engine(**options) as plain,
        asyncstep.open_engine(speculative_config=spec, **options) as fast,
    ):
        for engine in (plain, fast):  # warm up: first steps, kernels, caches
            await one_request(engine, "Hello!", 8)
        for category, texts in prompts.items():
            decode = {"off": 0.0, "on": 0.0}  # first token to last
            total = {"off": 0.0, "on": 0.0}
            tokens = {"off": 0, "on": 0}
            same = 0
            before = fast.statistics()
            for _ in range(args.rounds):
                for text in texts:
                    for mode, engine in (("off", plain), ("on", fast)):
                        t_decode, t_total, ids = await one_request(engine, text, args.max_tokens)
                        decode[mode] += t_decode
                        total[mode] += t_total
                        tokens[mode] += len(ids)
                        if mode == "off":
                            ids_off = ids
                    same += ids == ids_off
            after = fast.statistics()
            drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
            accepted = (
                after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
            )
            num = len(texts) * args.rounds
            # Decode rate: the tokens after each request's first over the time after it.
            off = (tokens["off"] - num) / decode["off"]
            on = (tokens["on"] - num) / decode["on"]
            results[category] = {
                "decode_tok_s_without": round(off, 2),
                "decode_tok_s_with": round(on, 2),
                "decode_ratio": round(on / off, 3),
                "e2e_tok_s_without": round(tokens["off"] / total["off"], 2),
                "e2e_tok_s_with": round(tokens["on"] / total["on"], 2),
                "e2e_ratio": round(tokens["on"] / total["on"] / (tokens["off"] / total["off"]), 3),
                "acceptance_rate": round(accepted / drafts, 3) if drafts else 0.0,
                "draft_tokens": drafts,
                "tokens_without": tokens["off"],
                "tokens_with": tokens["on"],
                "same_outputs": f"{same}/{num}",
            }
            print(f"{category:>11}: {json.dumps(results[category])}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF or HF directory (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--draft", help="method draft_model with this draft checkpoint")
    parser.add_argument(
        "--draft-layers", type=int, help="method draft_model: the model's first N layers"
    )
    parser.add_argument("--cpu-threads", type=int, help="torch threads of each engine's forward")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    load_before = load_average()
    print(f"load average before: {load_before}", flush=True)
    results = trio.run(run, args)
    load_after = load_average()
    print(f"load average after: {load_after}")
    if args.out is not None:
        record = {
            "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores",
            "load_average_before": load_before,
            "load_average_after": load_after,
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
