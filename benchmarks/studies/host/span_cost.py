"""Host cost of one step-timeline span, tracing on and off.

python benchmarks/studies/host/span_cost.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import structlog

from asyncstep.logging import bind_rank, configure_logging
from asyncstep.logging.spans import now_us, record_span


def per_span_us(n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        record_span("prepare", "step", now_us(), 100)
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    bind_rank(0)
    with tempfile.TemporaryDirectory() as tmp, structlog.contextvars.bound_contextvars(step=1):
        configure_logging("warning", Path(tmp) / "spans.jsonl", console=False)
        on = min(per_span_us(20_000) for _ in range(5))
        configure_logging("warning", console=False)
    off = min(per_span_us(200_000) for _ in range(5))
    print(f"span, tracing on: {on:.2f} us; tracing off: {off:.3f} us (best of 5)")


if __name__ == "__main__":
    main()
