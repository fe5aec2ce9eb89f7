"""The table of docs/performance.md's CPU peers section from this folder's
runs of ``benchmarks/cpu_peers.py``: each row the median over its rounds
(min-max after it), ``before_*`` the code before issue 37's precision
change (``/work/wt-old`` at de95ad2), ``after_*`` after it, ``peers.json``
the other engines (one run). Rounds 1-4 ran on one VM, 5-6 on a second of
the same kind (2-core AMD EPYC, AVX512-BF16), each alternating before and
after. ``python3 summarize.py`` prints Markdown."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
Round = dict[str, Any]


def rounds() -> dict[str, list[Round]]:
    """'side engine-spec' -> each round's offline and serve figures."""
    out: dict[str, list[Round]] = {}
    for path in sorted(HERE.glob("*.json")):
        side = {"before": "before", "after": "now"}.get(path.name.split("_")[0], "peer")
        data = json.loads(path.read_text())
        for spec, offline in data["offline"].items():
            out.setdefault(f"{side} {spec}", []).append(
                {"offline": offline, "serve": data["serve"].get(spec)}
            )
    return out


def cell(runs: list[Round], pick: Callable[[Round], float | None], fmt: str = "{:.0f}") -> str:
    values = [v for r in runs if (v := pick(r)) is not None]
    if not values:
        return "—"
    text = fmt.format(statistics.median(values))
    if len(values) > 1:
        text += f" ({fmt.format(min(values))}–{fmt.format(max(values))})"
    return text


def served(c: int, key: str) -> Callable[[Round], float | None]:
    return lambda r: None if not r["serve"] else r["serve"][f"c{c}"][key]


def main() -> None:
    heads = ["engine (runs)", "16 at once, tok/s", "64 at once", "batch-1 ITL, ms"]
    heads += ["serve c=8: tok/s", "TTFT p50, s", "serve c=32: tok/s", "TTFT p50, s"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for name, runs in sorted(rounds().items()):
        print(
            f"| {name} ({len(runs)}) "
            f"| {cell(runs, lambda r: r['offline']['n16']['out_tok_s'])} "
            f"| {cell(runs, lambda r: r['offline']['n64']['out_tok_s'])} "
            f"| {cell(runs, lambda r: r['offline']['b1']['itl_s'] * 1e3, '{:.2f}')} "
            f"| {cell(runs, served(8, 'out_tok_s'))} "
            f"| {cell(runs, served(8, 'ttft_p50'), '{:.2f}')} "
            f"| {cell(runs, served(32, 'out_tok_s'))} "
            f"| {cell(runs, served(32, 'ttft_p50'), '{:.2f}')} |"
        )


if __name__ == "__main__":
    main()
