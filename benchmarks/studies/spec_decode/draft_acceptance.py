"""How often a layer-truncated copy of a GGUF model agrees with the model
(``draft_model`` speculation's acceptance): for each layer count, the
first N layers as the draft (``write_truncated_gguf``), greedy, ``k``
drafts a step, the chat prompts of ``benchmarks/studies/spec_decode/prompts/spec_decode.json``;
prints and writes the drafted and accepted counts (acceptance is
deterministic: no timing here, any machine load will do).

    python3 -m benchmarks.draft_acceptance --layers 12 18 22 26 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import trio
from spec_decode import PROMPTS, truncated_draft

import asyncstep
from asyncstep import SamplingParams


async def acceptance(model: str | None, layers: int, k: int, max_tokens: int) -> dict[str, Any]:
    draft = truncated_draft(model, layers)
    prompts = [p for texts in json.loads(PROMPTS.read_text()).values() for p in texts]
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
    options: dict[str, Any] = {"model": model} if model else {}
    async with asyncstep.open_engine(speculative_config=spec, **options) as engine:
        for prompt in prompts:
            chat = [{"role": "user", "content": prompt}]
            await engine.generate(chat, SamplingParams(temperature=0, max_tokens=max_tokens))
        stats = engine.statistics()
    drafted, accepted = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
    return {
        "draft_layers": layers,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "accepted_per_position": list(stats.spec_decode_num_accepted_tokens_per_pos),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a GGUF (default: the embedded model)")
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 18, 22, 26])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for layers in args.layers:
        row = trio.run(acceptance, args.model, layers, args.k, args.max_tokens)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out is not None:
        record = {
            "command": " ".join(["python3 -m benchmarks.draft_acceptance", *sys.argv[1:]]),
            "k": args.k,
            "results": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
