"""CPU smoke test of ``benchmarks/host_cpu.py``: every part runs end to end
on tiny sizes (HF included) and returns sane figures; no timing assertions
(performance lives in the benchmark, as a ratio, not in tests)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

ARGV = ["--num-requests", "4", "--output-len", "4", "--prompt-len-range", "4", "12"]
ARGV += ["--repeats", "1", "--warmup-requests", "2", "--busy-ms", "0.5", "--skip-steps", "1"]


def _import(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import host_cpu  # type: ignore[import-not-found]

    return host_cpu


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_the_caller_on_asyncio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--backend asyncio``: the caller's loop, the busy caller's among it, is asyncio's."""
    host_cpu = _import(monkeypatch)
    out = tmp_path / "host.json"
    argv = [*ARGV, "--no-hf", "--no-spans", "--busy-streams", "--backend", "asyncio"]
    assert host_cpu.main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["options"]["backend"] == "asyncio"
    ours = result["ours"]
    assert set(ours) == {"generate", "stream", "busy_generate", "busy_stream"}
    assert all(positive(v["tok_s"]) for v in ours.values())
    assert ours["busy_stream"]["rounds"][0]["holds"] >= 1
    other = ours["generate"]["rounds"][0]["other_cores"]
    assert other is None or other >= 0  # the engine-core process counts as ours


def test_runs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host_cpu = _import(monkeypatch)
    out = tmp_path / "host.json"
    logger = logging.getLogger("asyncstep")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert host_cpu.main([*ARGV, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["argv"][:2] == ["--num-requests", "4"] and "host_cpu.py" in result["command"]
    assert result["machine"]["cpu_count"] >= 1 and result["date"].endswith("+00:00")
    workload = result["workload"]
    assert workload["output_tokens"] == 16 and 16 <= workload["prompt_tokens"] <= 48

    hf, ours = result["hf"], result["ours"]
    assert "error" not in hf, hf
    assert positive(hf["tok_s"]) and hf["batch"][0] == 4
    assert set(ours) == {"generate", "stream", "busy_generate"}
    assert all(positive(v["tok_s"]) and len(v["seconds"]) == 1 for v in ours.values())
    assert 4 <= ours["stream"]["rounds"][0]["chunks"] <= 16  # >= 1 a request, <= 1 a token
    busy = ours["busy_generate"]["rounds"][0]
    assert busy["holds"] >= 1 and 0 < busy["held_fraction"] <= 1
    ratios = result["ratios"]
    assert ratios.keys() == {"generate_over_hf", "stream_over_hf", "busy_generate_over_generate"}
    assert all(positive(v) for v in ratios.values()), ratios

    # asyncstep's logger as it was (later tests capture its events).
    assert (list(logger.handlers), logger.level, logger.propagate) == before

    phases = result["spans"]["phases"]
    assert set(phases) == {"batch_1", "batch_4"}
    for phase in phases.values():
        assert phase["steps"] >= 1
        if phase["steps"] > 1:
            assert positive(phase["step_period_us"])
        names = {row["name"]: row for row in phase["rows"]}
        assert {"schedule", "prepare", "launch"} <= names.keys(), names.keys()
        assert names["schedule"]["count"] == phase["steps"]
        assert all(row["us_per_step"] >= 0 and row["count"] >= 1 for row in phase["rows"])


def test_span_table_aggregates_the_selected_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    host_cpu = _import(monkeypatch)
    from asyncstep.logging.trace import Span

    def s(name: str, task: str, step: int, ts: int, dur: int) -> tuple[str, Span]:
        return ("main", Span(name, task, None if task == "engine" else 0, step, ts, dur))

    spans = [s("schedule", "engine", i, 1000 * i, 10 * i) for i in range(4)]
    spans += [s("prepare", "step", i, 1000 * i + 50, 100) for i in range(4)]
    spans += [s("output", "sampler", 2, 2500, 7), s("output", "sampler", 2, 2600, 9)]
    steps = {i: {"num_reqs": 2, "num_tokens": 2 if i else 9} for i in range(4)}
    selected, how = host_cpu.steady_steps(spans, steps, (0, 10_000), 2, skip=1)
    assert selected == [2, 3] and "num_reqs" in how  # step 0 is a prefill, step 1 skipped
    table = host_cpu.span_table(spans, selected)
    rows = {row["name"]: row for row in table["rows"]}
    assert [row["name"] for row in table["rows"]] == ["schedule", "prepare", "output"]
    assert rows["schedule"]["us_per_step"] == 25 and rows["schedule"]["count"] == 2
    assert rows["output"]["us_per_step"] == 8 and rows["output"]["us_per_span"] == 8
    assert table["steps"] == 2 and table["step_period_us"] == 1000
