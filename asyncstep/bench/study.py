"""What the one-off studies under ``benchmarks/studies/`` share (their
scripts import it; the maintained measurements do not): seeded prompts of
one length, a traced decode's device figures (ITL and busy fraction from the
step-timeline spans), and a study's rows written as plain JSON after the
run's command, date and machine (the format of the studies' results; the
maintained measurements write :class:`~asyncstep.bench.results.Result`
instead).

May import :mod:`asyncstep.logging`; torch only where a table is written.
"""

from __future__ import annotations

import itertools
import json
import platform
import random
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asyncstep.logging.trace import Span

__all__ = ["device_figures", "make_prompts", "write_results"]


def make_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids in [3, vocab), seeded."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def device_figures(spans: list[Span], first_step: int) -> dict[str, float]:
    """ITL and busy fraction from the device spans of steady decode steps
    (from ``first_step``, leaving out the last two)."""
    fwd = {s.step: s for s in spans if s.task == "device" and s.name == "forward"}
    copy = {s.step: s for s in spans if s.task == "device" and s.name == "sample_copy"}
    steps = sorted(n for n in fwd if n is not None and n >= first_step and n in copy)
    steps = steps[: len(steps) - 2]
    if len(steps) < 4:
        raise RuntimeError(f"too few steady steps ({len(steps)}): raise --output-len")
    starts = [fwd[n].ts_us for n in steps]
    ends = [copy[n].end_us for n in steps]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    window = ends[-1] - starts[0]
    # Union of the steps' [start, end] intervals (they may overlap with overlap on).
    busy, cur_start, cur_end = 0, starts[0], ends[0]
    for s, e in zip(starts[1:], ends[1:], strict=True):
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    return {
        "device_itl_ms": statistics.median(gaps) / 1e3,
        "gpu_busy": busy / window,
        "steady_steps": len(steps),
    }


def write_results(out: Path, rows: list[dict[str, Any]], **facts: Any) -> None:
    """Write ``rows`` to ``out`` (its folder made if missing) as indented JSON, after
    the run's command, date, machine, device and torch version, and ``facts``."""
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        **facts,
        "rows": rows,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
