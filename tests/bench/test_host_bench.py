"""CPU smoke test of ``asyncstep.bench.host_cpu``: every part runs end to end
on tiny sizes (HF included) and writes sane figures in the one results
format; no timing assertions (performance lives in the benchmark, as a
ratio, not in tests)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from asyncstep.bench import host_cpu, host_spans
from asyncstep.bench.results import Case, decode

ARGV = ["--num-requests", "4", "--output-len", "4", "--prompt-len-range", "4", "12"]
ARGV += ["--repeats", "1", "--warmup-requests", "2", "--busy-ms", "0.5", "--skip-steps", "1"]


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def ours(cases: list[Case]) -> dict[str, Case]:
    return {c.params["variant"]: c for c in cases if c.params["system"] == "asyncstep"}


def test_the_caller_on_asyncio(tmp_path: Path) -> None:
    """``--backend asyncio``: the caller's loop, the busy caller's among it, is asyncio's."""
    out = tmp_path / "host.json"
    argv = [*ARGV, "--no-hf", "--no-spans", "--busy-streams", "--backend", "asyncio"]
    assert host_cpu.main([*argv, "--out", str(out)]) == 0
    result = decode(out.read_bytes())
    assert result.mode == "host_cpu" and result.options["backend"] == "asyncio"
    variants = ours(result.cases)
    assert set(variants) == {"generate", "stream", "busy_generate", "busy_stream"}
    assert all(positive(v.figures["tok_s"]) for v in variants.values())
    assert variants["busy_stream"].detail["rounds"][0]["holds"] >= 1
    other = variants["generate"].detail["rounds"][0]["other_cores"]
    assert other is None or other >= 0  # the engine-core process counts as ours


def test_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    logger = logging.getLogger("asyncstep")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert host_cpu.main([*ARGV, "--out", str(out)]) == 0
    result = decode(out.read_bytes())
    assert result.command[:3] == ["python3", "-m", "asyncstep.bench.host_cpu"]
    assert result.command[3:5] == ["--num-requests", "4"]
    assert result.machine.cpu_count >= 1 and result.started.endswith("+00:00")
    workload = result.extra["workload"]
    assert workload["output_tokens"] == 16 and 16 <= workload["prompt_tokens"] <= 48

    (hf,) = [c for c in result.cases if c.params["system"] == "hf"]
    assert "error" not in hf.detail, hf.detail
    assert positive(hf.figures["tok_s"]) and hf.detail["batch"][0] == 4
    variants = ours(result.cases)
    assert set(variants) == {"generate", "stream", "busy_generate"}
    assert all(
        positive(v.figures["tok_s"]) and len(v.detail["seconds"]) == 1 for v in variants.values()
    )
    # >= 1 chunk a request, <= 1 a token
    assert 4 <= variants["stream"].detail["rounds"][0]["chunks"] <= 16
    busy = variants["busy_generate"].detail["rounds"][0]
    assert busy["holds"] >= 1 and 0 < busy["held_fraction"] <= 1
    ratios = result.extra["ratios"]
    assert ratios.keys() == {"generate_over_hf", "stream_over_hf", "busy_generate_over_generate"}
    assert all(positive(v) for v in ratios.values()), ratios

    # asyncstep's logger as it was (later tests capture its events).
    assert (list(logger.handlers), logger.level, logger.propagate) == before

    phases = result.extra["spans"]["phases"]
    assert set(phases) == {"batch_1", "batch_4"}
    for phase in phases.values():
        assert phase["steps"] >= 1
        if phase["steps"] > 1:
            assert positive(phase["step_period_us"])
        names = {row["name"]: row for row in phase["rows"]}
        assert {"schedule", "prepare", "launch"} <= names.keys(), names.keys()
        assert names["schedule"]["count"] == phase["steps"]
        assert all(row["us_per_step"] >= 0 and row["count"] >= 1 for row in phase["rows"])


def test_span_table_aggregates_the_selected_steps() -> None:
    from asyncstep.logging.trace import Span

    def s(name: str, task: str, step: int, ts: int, dur: int) -> tuple[str, Span]:
        return ("main", Span(name, task, None if task == "engine" else 0, step, ts, dur))

    spans = [s("schedule", "engine", i, 1000 * i, 10 * i) for i in range(4)]
    spans += [s("prepare", "step", i, 1000 * i + 50, 100) for i in range(4)]
    spans += [s("output", "sampler", 2, 2500, 7), s("output", "sampler", 2, 2600, 9)]
    steps = {i: {"num_reqs": 2, "num_tokens": 2 if i else 9} for i in range(4)}
    selected, how = host_spans.steady_steps(spans, steps, (0, 10_000), 2, skip=1)
    assert selected == [2, 3] and "num_reqs" in how  # step 0 is a prefill, step 1 skipped
    table = host_spans.span_table(spans, selected)
    rows = {row["name"]: row for row in table["rows"]}
    assert [row["name"] for row in table["rows"]] == ["schedule", "prepare", "output"]
    assert rows["schedule"]["us_per_step"] == 25 and rows["schedule"]["count"] == 2
    assert rows["output"]["us_per_step"] == 8 and rows["output"]["us_per_span"] == 8
    assert table["steps"] == 2 and table["step_period_us"] == 1000
