"""Where a CPU precision loses greedy tokens: each variant of the embedded
model (engine options as JSON) walked along the float32 reference's greedy
tokens (``weight_packing=none, dtype=float32``, which gives HF transformers'
fp32 tokens: tests/models/test_smollm2.py), its prompt log-probs read at
every position. Per variant: positions whose top token differs from the
reference's (top-1 flips), the largest difference of the reference token's
log-prob, and whether its own greedy tokens equal the reference's
(prompts whose greedy run parts from it, at which token).

    python3 benchmarks/studies/cpu_precision/cpu_precision.py '{}' '{"dtype": "bfloat16"}' \\
        --out benchmarks/results/cpu/precision/variants.json

A variant's ``"engine_process": false`` runs its engine in this process.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.cpu_features import cpu_flags

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Explain in one sentence why the sky is blue, and mention the name of the effect.",
    "Hi",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "List the planets of the solar system.",
    "Who wrote Hamlet?",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Tell me a short story about a robot.",
]
REFERENCE = {"dtype": "float32", "weight_packing": "none"}
Walk = list[tuple[list[int], list[float]]]  # per position: (ids, log-probs)


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


async def greedy(options: dict[str, Any], tokens: int) -> list[tuple[list[int], list[int]]]:
    """Each question's prompt ids and greedy tokens (EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    out = []
    async with asyncstep.open_engine(**options) as engine:
        for q in QUESTIONS:
            ids = list(await engine.encode_prompt(chat(q)))
            out.append((ids, (await engine.generate(ids, params)).token_ids))
    return out


async def walk(options: dict[str, Any], runs: list[tuple[list[int], list[int]]]) -> list[Walk]:
    """Prompt log-probs (the forced token's, then the top one's) along each run."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    walks = []
    async with asyncstep.open_engine(**options) as engine:
        for ids, tokens in runs:
            done = await engine.generate(ids + tokens, params)
            assert done.prompt_logprobs is not None
            at = done.prompt_logprobs[len(ids) :]
            walks.append([(p.token_ids, p.logprobs) for p in at if p is not None])
    return walks


def compare(reference: list[Walk], variant: list[Walk]) -> dict[str, Any]:
    flips, worst, positions = 0, 0.0, 0
    for ref, got in zip(reference, variant, strict=True):
        for (ref_ids, ref_lp), (got_ids, got_lp) in zip(ref, got, strict=True):
            positions += 1
            flips += ref_ids[-1] != got_ids[-1]
            worst = max(worst, abs(ref_lp[0] - got_lp[0]))
    return {"positions": positions, "top1_flips": flips, "max_logprob_error": round(worst, 5)}


def parted(reference: list[tuple[list[int], list[int]]], runs: list[Any]) -> dict[str, int]:
    """Question -> the first token where a variant's greedy run parts from the reference's."""
    out = {}
    for q, (_, ref), (_, got) in zip(QUESTIONS, reference, runs, strict=True):
        at = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None)
        if at is not None:
            out[q] = at
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    reference = await greedy(REFERENCE, args.tokens)
    ref_walk = await walk(REFERENCE, reference)
    rows = []
    for text in args.variants:
        options = json.loads(text)
        row = {"options": options, **compare(ref_walk, await walk(options, reference))}
        row["greedy_parts_from_reference"] = parted(reference, await greedy(options, args.tokens))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {
        "command": " ".join(["python3", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, "
        + ("AMX " if "amx_tile" in cpu_flags() else "")
        + ("AVX512-BF16 " if "avx512_bf16" in cpu_flags() else "")
        + ("AVX512-VNNI " if "avx512_vnni" in cpu_flags() else "")
        + ("AVX2" if "avx2" in cpu_flags() else ""),
        "tokens": args.tokens,
        "questions": QUESTIONS,
        "variants": rows,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("variants", nargs="+", help="engine options, one JSON object each")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = trio.run(main, args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
