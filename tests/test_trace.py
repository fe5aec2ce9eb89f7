"""``asyncstep trace``: span logs (with junk and other events) read back, the
Chrome trace's structure, the summary, the PNG, ``--steps``, a clear error
for each bad input, and spans recorded for real through the logging set-up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from asyncstep.logging import bind_rank, bound_step, configure_logging
from asyncstep.logging import spans as span_log
from asyncstep.logging.trace import (
    Span,
    add_trace_parser,
    draw_timeline,
    load_spans,
    parse_steps,
    run_trace_command,
    select_steps,
    summarize,
    to_chrome_trace,
    tracks,
    write_chrome_trace,
)

T0 = 1_764_450_000_000_000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def span_line(name: str, task: str, ts: int, dur: int, **fields: Any) -> str:
    record = {"event": "span", "name": name, "task": task, "ts_us": T0 + ts, "dur_us": dur}
    record.update(fields, level="debug", logger="asyncstep.trace", timestamp="2025-11-29T00:00Z")
    return json.dumps(record)


def rank_log(rank: int, steps: range) -> list[str]:
    """A rank's log: per step recv/step/device/sampler/send spans, plus noise."""
    lines = [json.dumps({"event": "rank started", "rank": rank}), "not json at all", "[1, 2]", ""]
    for step in steps:
        base = step * 1000 + rank * 10
        ids = {"rank": rank, "step": step}
        lines += [
            span_line("recv_wait", "recv", base, 50, **ids),
            span_line("prepare", "step", base + 50, 100, **ids),
            span_line("forward", "device", base + 150, 300, **ids),
            span_line("sample", "sampler", base + 450, 80, **ids),
            span_line("output", "send", base + 530, 20, **ids),
            json.dumps({"event": "step", "rank": rank, "step": step, "tokens": 4}),
        ]
    lines.append('{"event": "span", "name": "broken"')  # truncated line
    lines.append(json.dumps({"event": "span", "name": "no times", "task": "step"}))
    return lines


def engine_log(steps: range) -> list[str]:
    lines = ["garbage \x00 line"]
    for step in steps:
        lines.append(span_line("schedule", "engine", step * 1000 - 40, 30, step=step))
    lines.append(span_line("idle", "engine", 3500, 200))  # no step, between steps 3 and 4
    lines.append(span_line("startup", "engine", -5000, 100))  # no step, long before
    return lines


STEPS = range(1, 7)
SPANS_PER_RANK = 5 * len(STEPS)
ENGINE_SPANS = len(STEPS) + 2
TOTAL = 2 * SPANS_PER_RANK + ENGINE_SPANS


@pytest.fixture
def logs(tmp_path: Path) -> list[Path]:
    paths = []
    for name, lines in [
        ("rank0.jsonl", rank_log(0, STEPS)),
        ("rank1.jsonl", rank_log(1, STEPS)),
        ("engine.jsonl", engine_log(STEPS)),
    ]:
        path = tmp_path / name
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def test_load_spans_skips_junk_and_sorts(logs: list[Path]) -> None:
    spans = load_spans(logs)
    assert len(spans) == TOTAL
    assert [s.ts_us for s in spans] == sorted(s.ts_us for s in spans)
    assert spans[0] == Span("startup", "engine", None, None, T0 - 5000, 100)
    assert spans[0].end_us == T0 - 4900
    assert {s.rank for s in spans} == {None, 0, 1}
    assert {s.task for s in spans} == {"recv", "step", "device", "sampler", "send", "engine"}
    forward = [s for s in spans if s.name == "forward" and s.rank == 1 and s.step == 2]
    assert forward == [Span("forward", "device", 1, 2, T0 + 2160, 300)]


def test_chrome_trace_structure(logs: list[Path]) -> None:
    spans = load_spans(logs)
    trace = json.loads(json.dumps(to_chrome_trace(spans)))  # JSON-clean
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(complete) == TOTAL
    assert len(meta) == 2 * 3 + 2 * 11  # name + sort index of 3 processes and 11 tracks

    # Every span once, ts relative to the first span.
    seen = sorted((e["name"], e["cat"], T0 - 5000 + e["ts"], e["dur"]) for e in complete)
    assert seen == sorted((s.name, s.task, s.ts_us, s.dur_us) for s in spans)
    assert min(e["ts"] for e in complete) == 0
    first = next(e for e in complete if e["name"] == "startup")
    assert first["ts"] == 0 and first["args"] == {}
    assert all(
        e["args"] == {"step": s.step} for e, s in zip(complete, spans, strict=True) if s.step
    )

    # Processes: engine, rank 0, rank 1, in that order; pids consistent.
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names == {0: "engine", 1: "rank 0", 2: "rank 1"}
    order = {e["pid"]: e["args"]["sort_index"] for e in meta if e["name"] == "process_sort_index"}
    assert sorted(order, key=order.__getitem__) == [0, 1, 2]
    for e in complete:
        assert names[e["pid"]] == ("engine" if e["cat"] == "engine" else f"rank {e['pid'] - 1}")

    # Threads: one tid per task, the same in every process, in track order.
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} == set(threads)
    tid_of = {task: tid for (_, tid), task in threads.items()}
    assert len(tid_of) == len(set(tid_of.values())) == 6
    assert all(tid_of[e["cat"]] == e["tid"] for e in complete)
    assert sorted(tid_of, key=tid_of.__getitem__) == [
        "recv",
        "step",
        "device",
        "sampler",
        "send",
        "engine",
    ]
    sort = {
        (e["pid"], e["tid"]): e["args"]["sort_index"] for e in meta if "thread_sort" in e["name"]
    }
    assert sort == {key: key[1] for key in threads}


def test_write_chrome_trace_and_tracks(logs: list[Path], tmp_path: Path) -> None:
    spans = load_spans(logs)
    out = tmp_path / "trace.json"
    write_chrome_trace(spans, out)
    assert json.loads(out.read_text()) == to_chrome_trace(spans)
    assert tracks(spans)[:3] == [(None, "engine"), (0, "recv"), (0, "step")]
    assert len(tracks(spans)) == 11
    assert to_chrome_trace([]) == {"traceEvents": [], "displayTimeUnit": "ms"}


def test_summarize(logs: list[Path]) -> None:
    summary = summarize(load_spans(logs))
    assert list(summary)[:5] == [
        "recv/recv_wait",
        "step/prepare",
        "device/forward",
        "sampler/sample",
        "send/output",
    ]
    assert summary["device/forward"] == {"count": 12.0, "total_ms": 3.6, "mean_ms": 0.3}
    assert summary["engine/schedule"]["count"] == 6
    assert summary["engine/idle"] == {"count": 1.0, "total_ms": 0.2, "mean_ms": 0.2}


def test_select_steps_keeps_overlapping_stepless_spans(logs: list[Path]) -> None:
    spans = load_spans(logs)
    chosen = select_steps(spans, (3, 4))
    assert {s.step for s in chosen} == {3, 4, None}
    assert len([s for s in chosen if s.step is not None]) == 2 * (2 * 5 + 1)
    assert [s.name for s in chosen if s.step is None] == ["idle"]  # not "startup"
    assert [s.step for s in select_steps(spans, (6, 6)) if s.rank == 0] == [6] * 5
    with pytest.raises(ValueError, match="no spans in steps 40:50"):
        select_steps(spans, (40, 50))


def test_parse_steps() -> None:
    assert parse_steps("3:5") == (3, 5)
    assert parse_steps("7") == (7, 7)
    for bad in ["a:b", "1:2:3", "", "3:"]:
        with pytest.raises(ValueError, match="--steps wants A:B"):
            parse_steps(bad)
    with pytest.raises(ValueError, match="after the last"):
        parse_steps("5:3")


def read_png(path: Path) -> Any:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC
    return matplotlib.image.imread(path)


def test_draw_timeline_png(logs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    draw_timeline(load_spans(logs), out, title="two ranks")
    height, width = read_png(out).shape[:2]
    assert (width, height) == (14 * 120, round((0.5 * 11 + 2) * 120))


def test_draw_timeline_steps(logs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "steps.png"
    draw_timeline(load_spans(logs), out, steps=(2, 2))
    height, _ = read_png(out).shape[:2]
    assert height == round((0.5 * 11 + 2) * 120)  # every track has a span in step 2


def test_run_trace_command(logs: list[Path], tmp_path: Path) -> None:
    paths = [str(p) for p in logs]
    out = tmp_path / "t.json"
    line = run_trace_command(paths, str(out), None)
    assert line == f"wrote {out}: {TOTAL} spans, 3 processes, 11 tracks"
    line = run_trace_command(paths[:1], str(out), "2:3")
    assert line == f"wrote {out}: 10 spans (steps 2:3), 1 process, 5 tracks"
    assert len([e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]) == 10
    png = tmp_path / "t.png"
    assert run_trace_command(paths, str(png), "1:2").startswith(f"wrote {png}: ")
    read_png(png)
    txt = tmp_path / "t.txt"
    line = run_trace_command(paths[:1], str(txt), "2:2")
    assert line == f"wrote {txt}: 5 spans (steps 2:2), 1 process, 5 tracks"
    header, *rows = txt.read_text().splitlines()
    assert header.split() == ["start", "ms", "dur", "ms", "process", "task", "span", "step"]
    assert [r.split()[-3:] for r in rows] == [
        ["recv", "recv_wait", "2"],
        ["step", "prepare", "2"],
        ["device", "forward", "2"],
        ["sampler", "sample", "2"],
        ["send", "output", "2"],
    ]
    assert rows[0].split()[:2] == ["0.000", "0.050"] and rows[2].split()[:2] == ["0.150", "0.300"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="asyncstep")
    add_trace_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["trace", *argv])


def test_cli_handler_ok(
    logs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.json"
    args = parse(*map(str, logs), "-o", str(out), "--steps", "1:1")
    assert (args.logs, args.output, args.steps) == ([str(p) for p in logs], str(out), "1:1")
    assert args.handler(args) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith(f"wrote {out}: ") and stderr == ""
    assert out.exists()


def test_cli_requires_output_and_logs(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in [("log.jsonl",), ("-o", "x.json")]:
        with pytest.raises(SystemExit) as exit_info:
            parse(*argv)
        assert exit_info.value.code == 2
    capsys.readouterr()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "missing.jsonl: no such log file"),
        ("directory", ": is not a file"),
        ("no spans", "no spans (was the run logged with --log-json?)"),
        ("bad suffix", "the output must end in .json or .png or .txt (got '.svg')"),
        ("no suffix", "the output must end in .json or .png or .txt (got 'none')"),
        ("bad steps", "--steps wants A:B (two step numbers), got 'x:2'"),
        ("reversed steps", "--steps 4:2: the first step is after the last"),
        ("empty steps", "no spans in steps 100:200"),
        ("output dir", "No such file or directory"),
    ],
)
def test_bad_input_gets_one_clear_line(
    case: str,
    message: str,
    logs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log, out, steps = str(logs[0]), str(tmp_path / "out.json"), []
    if case == "missing":
        log = str(tmp_path / "missing.jsonl")
    elif case == "directory":
        log = str(tmp_path)
    elif case == "no spans":
        log = str(tmp_path / "plain.jsonl")
        Path(log).write_text('{"event": "step", "step": 1}\nnot json\n')
    elif case == "bad suffix":
        out = str(tmp_path / "out.svg")
    elif case == "no suffix":
        out = str(tmp_path / "out")
    elif case == "output dir":
        out = str(tmp_path / "nowhere" / "out.json")
    else:
        steps = ["--steps", {"bad steps": "x:2", "reversed steps": "4:2"}.get(case, "100:200")]
    args = parse(log, "-o", out, *steps)
    assert args.handler(args) == 1
    stdout, stderr = capsys.readouterr()
    assert stdout == ""
    assert stderr.startswith("asyncstep: error: ") and message in stderr
    assert stderr.count("\n") == 1


def test_no_spans_only_when_no_file_has_any(logs: list[Path], tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert len(load_spans([empty, *logs])) == TOTAL
    with pytest.raises(ValueError, match=r"empty\.jsonl: no spans"):
        load_spans([empty])
    with pytest.raises(FileNotFoundError, match="no such log file"):
        load_spans([*logs, tmp_path / "gone.jsonl"])


def test_real_spans_round_trip(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    configure_logging(level="warning", json_file=log, console=False)
    try:
        assert span_log.tracing()
        bind_rank(3)
        with bound_step(11):
            with span_log.span("prepare", "step"):
                pass
            span_log.record_span("forward", "device", span_log.now_us(), 250)
        span_log.record_span("schedule", "engine", span_log.now_us(), 40, rank=None, step=12)
    finally:
        configure_logging(console=False)
        import structlog

        structlog.contextvars.unbind_contextvars("rank")
    assert not span_log.tracing()
    span_log.record_span("ignored", "step", span_log.now_us(), 1)  # tracing off: not logged

    spans = load_spans([log])
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == ["forward", "prepare", "schedule"]
    assert (by_name["prepare"].rank, by_name["prepare"].step) == (3, 11)
    assert (by_name["forward"].task, by_name["forward"].dur_us) == ("device", 250)
    assert by_name["forward"].step == 11
    assert (by_name["schedule"].rank, by_name["schedule"].step) == (None, 12)
    assert by_name["prepare"].dur_us >= 0
    trace = to_chrome_trace(spans)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 4}
