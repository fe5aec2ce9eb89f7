"""Forced tool calls are valid whatever is sampled: the measurement
``python3 -m asyncstep.bench.tool_validity`` run whole (200 seeded, sampled requests
across 10 tool sets, the real ``openai`` client): every call of every reply
that ended names a tool of its request, and its arguments validate against
that tool's schema."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncstep.bench.results import decode

MODULE = "asyncstep.bench.tool_validity"


def test_200_sampled_forced_calls_all_validate(tmp_path: Path) -> None:
    out = tmp_path / "validity.json"
    done = subprocess.run(
        [sys.executable, "-m", MODULE, "--requests", "200", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = decode(out.read_bytes())
    summary = result.extra["summary"]
    assert sum(c.figures["requests"] or 0 for c in result.cases) == 200
    assert summary["requests"] == 200 and summary["tool_sets"] == 10
    assert summary["judged"] >= 190, summary  # the rest cut by max_tokens (256)
    assert summary["valid"] == summary["judged"], done.stdout[-3000:]
    assert summary["calls"] >= summary["judged"]
