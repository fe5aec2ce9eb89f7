"""Where a traced run's time went, per process: for each rank (and the engine
and front end) and each ``task/name`` span, the count, the mean and the share
of the window the spans cover (a track busy 100 % of the window never waits).

    python benchmarks/studies/host/span_table.py LOG... [--from-step N] [--skip-last K]

LOGs are the span logs a traced run writes (``FILE``, ``FILE.core``,
``FILE.rank<N>``: pass them all). Steps before ``--from-step`` (warm-up,
prefill) and the last ``--skip-last`` are left out.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from asyncstep.logging.trace import Span, load_spans, process_name


def table(spans: list[Span], first: int, skip_last: int) -> list[str]:
    stepped = [s for s in spans if s.step is not None]
    if not stepped:
        return ["no spans with a step"]
    last = max(s.step for s in stepped if s.step is not None) - skip_last
    window = [s for s in stepped if s.step is not None and first <= s.step <= last]
    if not window:
        return [f"no spans in steps {first}..{last}"]
    t0 = min(s.ts_us for s in window)
    t1 = max(s.end_us for s in window)
    wall_us = max(t1 - t0, 1)
    rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for s in window:
        row = rows[process_name(s.rank), f"{s.task}/{s.name}"]
        row[0] += 1
        row[1] += s.dur_us
    lines = [
        f"steps {first}..{last}: window {wall_us / 1e3:.1f} ms",
        f"{'process':<10} {'task/name':<28} {'count':>6} {'mean us':>9} {'share':>6}",
    ]
    for (proc, name), (count, dur) in sorted(rows.items()):
        lines.append(f"{proc:<10} {name:<28} {count:>6} {dur / count:>9.0f} {dur / wall_us:>6.1%}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--from-step", type=int, default=0)
    parser.add_argument("--skip-last", type=int, default=2)
    args = parser.parse_args()
    print("\n".join(table(load_spans(args.logs), args.from_step, args.skip_last)))


if __name__ == "__main__":
    main()
