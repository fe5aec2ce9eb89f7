"""CPU smoke test of ``benchmarks/serve.py``: a handful of streamed requests
over HTTP (a real ``asyncstep serve``) and the same through the Python API,
in one run, on the tiny dummy model (the HTTP requests split over two
client processes); the JSON holds both runs' figures and their ratios."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "serve.py"


def test_the_serving_benchmark_runs_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    argv = [sys.executable, str(BENCH), "--num-prompts", "6", "--input-len", "12"]
    argv += ["--output-len", "5", "--max-concurrency", "3", "--goodput", "ttft:60000"]
    argv += ["--out", str(out), "--model", "tiny-llama", "--load-format", "dummy"]
    argv += ["--device", "cpu", "--no-engine-process", "--client-processes", "2"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "http/in-proc" in run.stdout
    record = json.loads(out.read_text())
    for mode in ("http", "in_process"):
        result = record["results"][mode]
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["output_throughput"] > 0 and result["goodput"] == result["request_throughput"]
        for name in ("ttft", "tpot", "itl", "e2el"):
            values = [result[f"{stat}_{name}_ms"] for stat in ("mean", "p50", "p90", "p99")]
            assert all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in values)
            assert values[1] <= values[2] <= values[3]
        # 6 requests of 5 tokens each: throughput and duration agree.
        assert math.isclose(result["output_throughput"] * result["duration_s"], 30)
    assert record["http_over_in_process"]["mean_e2el_ms"] > 0
