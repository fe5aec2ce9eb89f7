"""The cost of a forced tool call: inter-token latency of 32 requests at
once whose replies a tool's JSON-schema grammar forces (as ``tool_choice:
required`` does, :mod:`asyncstep.engine.chat.tools`), against 32 free ones, on
the embedded model, alternating rounds in one process; ITL of a request is
(last token - first token) / (tokens - 1), the median over requests.

    python3 benchmarks/studies/tools/tool_itl.py --out benchmarks/results/tools/itl.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import trio

import asyncstep
from asyncstep.engine.chat.tools import ForcedCalls
from asyncstep.structured_params import StructuredOutputsParams

NOTE = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 600, "maxLength": 2000}},
    "required": ["text"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Write a long note about the history of Paris."}]


def params(forced: bool, tokens: int, seed: int) -> asyncstep.SamplingParams:
    structured = None
    if forced:
        schema = ForcedCalls({"note": NOTE}, None, parallel=False).schema()
        structured = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return asyncstep.SamplingParams(
        temperature=0.8,
        seed=seed,
        max_tokens=tokens,
        ignore_eos=not forced,
        structured_outputs=structured,
    )


async def one(engine: asyncstep.Engine, sp: asyncstep.SamplingParams) -> float | None:
    times: list[float] = []
    async for chunk in engine.stream(PROMPT, sp):
        if chunk.token_ids:
            times.extend([time.perf_counter()] * len(chunk.token_ids))
    if len(times) < 8:
        return None
    return (times[-1] - times[0]) / (len(times) - 1)


async def round_itl(engine: asyncstep.Engine, forced: bool, batch: int, tokens: int) -> float:
    results: list[float | None] = [None] * batch

    async def run(i: int) -> None:
        results[i] = await one(engine, params(forced, tokens, i))

    async with trio.open_nursery() as nursery:
        for i in range(batch):
            nursery.start_soon(run, i)
    itls = [r for r in results if r is not None]
    return statistics.median(itls)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[float]] = {"free": [], "forced": []}
    async with asyncstep.open_engine(max_num_seqs=args.batch) as engine:
        await round_itl(engine, True, args.batch, 16)  # grammar compiled, caches warm
        for _ in range(args.rounds):
            for kind in ("free", "forced"):
                itl = await round_itl(engine, kind == "forced", args.batch, args.tokens)
                rounds[kind].append(itl * 1e3)
                print(f"{kind:6s} ITL {itl * 1e3:7.2f} ms", flush=True)
    free, forced = statistics.median(rounds["free"]), statistics.median(rounds["forced"])
    return {
        "itl_ms": rounds,
        "median_free_ms": free,
        "median_forced_ms": forced,
        "ratio": forced / free,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    load = os.getloadavg()
    result = trio.run(main_async, args)
    result |= {"load_avg_before": load, "load_avg_after": os.getloadavg()}
    print(json.dumps({k: v for k, v in result.items() if k != "itl_ms"}))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        command = "python3 benchmarks/studies/tools/tool_itl.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"
        )
        with open(args.out, "w") as f:
            json.dump({"command": command, **result}, f, indent=1)


if __name__ == "__main__":
    main()
