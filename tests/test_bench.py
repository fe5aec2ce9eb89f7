"""CPU smoke test of ``benchmarks/bench.py``: both modes run end to end on the
tiny shape (ours and HF in one run), and their JSON holds every field with
sane numbers; the floor arithmetic matches ``../shared/anchors.md``.

The two runs start together (one core each: ``OMP_NUM_THREADS=1`` keeps
torch's thread pools from stalling each other on a small machine).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
BENCH = BENCH_DIR / "bench.py"

LATENCY = ["latency", "--batch", "1", "2", "--prompt-len", "8", "--output-len", "4"]
LATENCY += ["--repeats", "5"]  # median of 5: a noisy CPU cannot turn HF's ITL negative
THROUGHPUT = ["throughput", "--num-requests", "4", "--min-len", "4", "--max-len", "12"]
COMMON = ["--shape", "tiny-llama", "--device", "cpu", "--no-record"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """Both modes' JSON, from two runs started at once."""
    tmp = tmp_path_factory.mktemp("bench")
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(BENCH), *argv, *COMMON, "--out", str(tmp / f"{mode}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for mode, argv in (("latency", LATENCY), ("throughput", THROUGHPUT))
    }
    out = {}
    for mode, proc in procs.items():
        log, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{mode} run failed:\n{log}"
        assert "copy bandwidth" in log and "ours/HF" in log, log
        out[mode] = json.loads((tmp / f"{mode}.json").read_text())
    yield out


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def check_header(result: dict[str, Any], mode: str) -> None:
    assert result["mode"] == mode and result["shape"] == "tiny-llama"
    assert result["command"][0].endswith("bench.py") and mode in result["command"]
    machine = result["machine"]
    assert {"gpu", "cpu_count", "torch", "transformers", "triton"} <= machine.keys()
    assert machine["cpu_count"] >= 1 and machine["torch"] and machine["transformers"]
    assert result["date"].endswith("+00:00")
    assert result["options"]["device"] == "cpu"
    assert positive(result["bandwidth_tb_s"])


def test_latency(results: dict[str, dict[str, Any]]) -> None:
    result = results["latency"]
    check_header(result, "latency")
    rows = {row["key"]: row for row in result["rows"]}
    assert set(rows) == {"b1_p8_o4", "b2_p8_o4"}
    for row in rows.values():
        ours, hf, floor = row["ours"], row["hf"], row["floor"]
        assert positive(ours["itl_ms"]) and positive(ours["ttft_ms"])
        assert "error" not in hf, hf
        assert positive(hf["itl_ms"]) and hf["source"] == "static cache, eager"
        assert len(hf["full_s"]) == 5 and all(positive(t) for t in hf["one_token_s"])
        assert positive(floor["floor_ms"]) and positive(floor["strict_floor_ms"])
        assert floor["strict_floor_ms"] <= floor["floor_ms"]
        assert floor["mean_context"] == 8 + 4 / 2
        assert all(positive(v) for v in row["ratios"].values()), row["ratios"]


def test_throughput(results: dict[str, dict[str, Any]]) -> None:
    result = results["throughput"]
    check_header(result, "throughput")
    (row,) = result["rows"]
    ours, hf, floor, config = row["ours"], row["hf"], row["floor"], row["config"]
    assert config["num_requests"] == 4
    assert 4 * 4 <= config["output_tokens"] <= 4 * 12
    assert positive(ours["wall_s"]) and positive(ours["output_tok_s"])
    assert ours["total_tok_s"] > ours["output_tok_s"]
    assert ours["traced"] and 0 < ours["gpu_busy"] <= 1
    assert "error" not in hf, hf
    assert positive(hf["output_tok_s"]) and positive(hf["wall_s"])
    assert hf["useful_output_tokens"] == config["output_tokens"]
    assert hf["computed_output_tokens"] >= hf["useful_output_tokens"]
    assert positive(floor["floor_s"]) and floor["output_tok_s"] > ours["output_tok_s"]
    assert all(positive(v) for v in row["ratios"].values()), row["ratios"]


def test_results_md(
    results: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows appended to RESULTS.md (written here to a temporary directory)."""
    bench = _import_bench(monkeypatch)
    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path)
    for mode, result in results.items():
        args = argparse.Namespace(mode=mode, shape="tiny-llama", tp=1, pp=1)
        bench.record_results(args, result, tmp_path / f"{mode}.json")
    lines = (tmp_path / "RESULTS.md").read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| date"))
    rows = lines[header + 2 :]
    assert len(rows) == 3  # two latency configurations, one throughput
    assert all(row.count("|") == lines[header].count("|") for row in rows)
    assert "b1 p8 o4" in rows[0] and "n4 len4-12" in rows[2]


def test_floor_matches_anchors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weight bytes (bf16) as in anchors.md: llama-1b 2.47 GB, llama-8b 16.06 GB;
    the floor at batch 1 at 4.15 TB/s about 0.59 / 3.85 ms (KV term included)."""
    bench = _import_bench(monkeypatch)
    from asyncstep.models.dummy import get_shape

    for shape, gb, floor_ms in (("llama-1b", 2.47, 0.59), ("llama-8b", 16.06, 3.85)):
        arch = get_shape(shape)
        weights, embed = bench.weight_bytes(arch, 2)
        assert round(weights / 1e9, 2) == gb
        assert (embed == 0) == arch.tie_word_embeddings
        floor = bench.step_floor(arch, 2, 4.15e12, 1, 128 + 64)
        assert floor["floor_ms"] == pytest.approx(floor_ms, rel=0.02)
        assert floor["strict_floor_ms"] <= floor["floor_ms"]


def test_engine_opt_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _import_bench(monkeypatch)
    assert bench.engine_opt("max_num_seqs=8") == ("max_num_seqs", 8)
    assert bench.engine_opt("enable_prefix_caching=false") == ("enable_prefix_caching", False)
    assert bench.engine_opt("x=True") == ("x", True)
    assert bench.engine_opt("attention_backend=torch") == ("attention_backend", "torch")
    assert bench.engine_opt("cudagraph_capture_sizes=[1,2]") == ("cudagraph_capture_sizes", [1, 2])
    with pytest.raises(argparse.ArgumentTypeError):
        bench.engine_opt("novalue")


def _import_bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import bench  # type: ignore[import-not-found]

    return bench


def test_rank_gpus_keep_every_communicator_on_distinct_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    from rank_gpus import rank_gpus  # type: ignore[import-not-found]

    assert rank_gpus(2, 2, 4) == [0, 1, 2, 3]  # enough GPUs: one each
    assert rank_gpus(2, 2, 2) == [0, 1, 1, 0]  # TP groups {0,1} {2,3}, PP groups {0,2} {1,3}
    eight_on_four = rank_gpus(4, 2, 4)
    assert [eight_on_four[r] for r in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [eight_on_four[r] for r in (4, 5, 6, 7)] == [1, 2, 3, 0]
    with pytest.raises(ValueError, match=r"ranks \[0, 2, 4\] .*needs at least 3 GPUs"):
        rank_gpus(2, 3, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        rank_gpus(2, 2, 0)


def _run_script(name: str, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(BENCH_DIR / name), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_pp_transfer_moves_lanes_and_whole_tensors_intact(tmp_path: Path) -> None:
    """PP = 2 x TP = 2 on gloo: every mode's round trip returns the tensors sent."""
    out = tmp_path / "transfer.json"
    argv = ["--hidden", "64", "--tokens", "1", "8", "--iters", "2", "--repeats", "1"]
    proc = _run_script("pp_transfer.py", *argv, "--warmup", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["tokens"], r["mode"]) for r in rows} == {
        (t, m)
        for t in (1, 8)
        for m in ("lane", "whole", "lane_raw", "whole_raw", "gather_raw", "meta_raw")
    }
    assert all(r["correct"] and r["one_way_us"] > 0 for r in rows)
    assert next(r for r in rows if r["tokens"] == 8)["bytes"] == 2 * 8 * 64 * 4  # two fp32 keys


def test_layout_tokens_with_ranks_started_outside_the_engine(tmp_path: Path) -> None:
    """The issue-6 check on the CPU: PP = 2 x TP = 2, ranks started by the
    script (``--rank-gpus``, the engine waits for them), tokens = one rank's."""
    out = tmp_path / "tokens.json"
    argv = ["--model", "tiny-llama", "--device", "cpu", "--rank-gpus", "2"]
    argv += ["--max-tokens", "6", "--prompt-lens", "3", "20", "--out", str(out)]
    proc = _run_script("layout_tokens.py", *argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["all_equal"] and set(result["runs"]) == {"overlap_on", "overlap_off"}
    assert result["reference"]["probe"]["output_changes"]  # the check can see the context
    assert all(len(t) == 6 for t in result["reference"]["tokens"])
