"""``asyncstep bench``: the README's commands (one per mode, tiny: random
weights of tiny-llama) run end to end, started together, one core each,
and write the one results format (decoded against its schema) with sane
figures; ``--help`` lists the engine flags; a bad flag or value is one line;
the floor arithmetic matches the anchors; and the parallel measurements
(``python3 -m asyncstep.bench.pp_transfer``, ``...layout_tokens``) on the CPU.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import msgspec
import pytest
import trio
from processes import serving_url

from asyncstep.bench import latency
from asyncstep.bench.args import CliFlags, parse_bench_args
from asyncstep.bench.floor import kv_bytes_per_token, step_floor, throughput_floor, weight_bytes
from asyncstep.bench.latency import stream_batch
from asyncstep.bench.rank_gpus import rank_gpus
from asyncstep.bench.results import FORMAT, Result, decode
from asyncstep.cli import (
    DERIVED_OPTIONS,
    add_engine_flag,
    add_engine_flags,
    config_from_args,
    engine_flag,
    main,
    server_config_from_args,
)
from asyncstep.config import engine_options
from asyncstep.datatypes import PackedReads, WeightReads
from asyncstep.engine.core.hybrid_kv_cache_manager import make_kv_cache_manager
from asyncstep.kv_cache_interface import kv_cache_groups
from asyncstep.models.dummy import get_shape
from asyncstep.server.config import server_options

ROOT = Path(__file__).resolve().parents[2]
FLAGS = CliFlags(add_engine_flags, add_engine_flag, config_from_args, server_config_from_args)


def readme_commands() -> dict[str, list[str]]:
    """docs/performance.md's small ``asyncstep bench`` runs, by mode."""
    text = (ROOT / "docs" / "performance.md").read_text()
    section = text.split("\n## Measuring: `asyncstep bench`\n", 1)[1].split("\n## ", 1)[0]
    found = [
        shlex.split(line[2:]) for line in section.splitlines() if line.startswith("$ asyncstep")
    ]
    return {argv[2]: argv for argv in found}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Result, str]]]:
    """Each README command's record and stdout, from runs started together."""
    tmp = tmp_path_factory.mktemp("bench")
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-m", *argv, "--output-json", str(tmp / f"{mode}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode, argv in readme_commands().items()
    }
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=280)
        assert proc.returncode == 0, f"{mode} failed:\n{stdout}\n{stderr}"
        data = (tmp / f"{mode}.json").read_bytes()
        jsonschema.validate(json.loads(data), msgspec.json.schema(Result))
        out[mode] = (decode(data), stdout)
    yield out


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_the_readme_runs_every_mode() -> None:
    assert set(readme_commands()) == {"latency", "throughput", "serve", "startup"}


@pytest.mark.parametrize("mode", ["latency", "throughput", "serve", "startup"])
def test_each_mode_writes_the_results_format(
    runs: dict[str, tuple[Result, str]], mode: str
) -> None:
    result, stdout = runs[mode]
    assert result.format == FORMAT and result.mode == mode
    assert result.command[:3] == ["asyncstep", "bench", mode]
    assert result.git is not None and re.fullmatch("[0-9a-f]{40}", result.git.revision)
    machine = result.machine
    assert machine.cpu and machine.cpu_count >= 1 and machine.torch and machine.python
    assert result.started.endswith("+00:00") and result.finished >= result.started
    assert result.engine is not None and result.engine["model"]["model"] == "tiny-llama"
    assert result.cases and all(case.figures for case in result.cases)
    assert f"asyncstep bench {mode}" in stdout  # the table's title


def test_latency_figures(runs: dict[str, tuple[Result, str]]) -> None:
    result, _ = runs["latency"]
    cases = {case.name: case for case in result.cases}
    assert set(cases) == {"b1_p8_o4", "b2_p8_o4"}
    for case in cases.values():
        f = case.figures
        for name in ("latency_avg_s", "latency_p99_s", "ttft_ms", "itl_ms", "hf_itl_ms"):
            assert positive(f[name]), (name, f)
        assert f["latency_p10_s"] <= f["latency_p50_s"] <= f["latency_p99_s"]  # type: ignore[operator]
        assert positive(f["floor_ms"]) and f["strict_floor_ms"] <= f["floor_ms"]  # type: ignore[operator]
        assert positive(f["itl_over_floor"]) and positive(f["itl_over_hf"])
        assert len(case.detail["runs"]) == 2
        assert case.detail["hf"]["source"] == "static cache, eager"
        assert case.detail["floor"]["mean_context"] == 8 + 4 / 2
        # The weights the engine's model reads in a step of the batch's size.
        reads = msgspec.convert(result.extra["weight_reads"], WeightReads)
        batch = case.params["batch_size"]
        assert case.detail["floor"]["weight_bytes"] == reads.step_bytes(batch)  # type: ignore[arg-type]
    assert cases["b2_p8_o4"].params == {"batch_size": 2, "input_len": 8, "output_len": 4}


def test_throughput_figures(runs: dict[str, tuple[Result, str]]) -> None:
    result, _ = runs["throughput"]
    (case,) = result.cases
    f, params = case.figures, case.params
    assert params["num_prompts"] == 4 and 4 * 4 <= params["output_tokens"] <= 4 * 12
    assert positive(f["requests_per_s"]) and positive(f["output_tok_s"])
    assert f["total_tok_s"] > f["output_tok_s"]  # type: ignore[operator]
    assert f["gpu_busy"] is not None and 0 < f["gpu_busy"] <= 1
    assert positive(f["hf_output_tok_s"])
    assert case.detail["hf"]["useful_output_tokens"] == params["output_tokens"]
    assert f["floor_output_tok_s"] > f["output_tok_s"]  # type: ignore[operator]


def test_serve_figures(runs: dict[str, tuple[Result, str]]) -> None:
    result, _ = runs["serve"]
    cases = {case.name: case for case in result.cases}
    assert set(cases) == {"http", "in_process"}
    for case in cases.values():
        f = case.figures
        assert f["completed"] == 6 and f["failed"] == 0
        assert f["goodput"] == f["request_throughput"]
        for name in ("ttft", "tpot", "itl", "e2el"):
            values = [f[f"{stat}_{name}_ms"] for stat in ("mean", "p50", "p90", "p99")]
            assert all(v is not None and v >= 0 for v in values), (name, values)
            assert values[1] <= values[2] <= values[3]  # type: ignore[operator]
        # 6 requests of 5 tokens each: throughput and duration agree.
        assert math.isclose(f["output_throughput"] * f["duration_s"], 30)  # type: ignore[operator]
    http = cases["http"].figures
    assert positive(http["client_cpu_s"]) and positive(http["server_cpu_s"])
    # Two replicas (--data-parallel-size 2): both cores measured, both looked up prompts.
    assert positive(http["engine_core_0_cpu_s"]) and positive(http["engine_core_1_cpu_s"])
    assert positive(http["replica_0_prompt_tokens"]) and positive(http["replica_1_prompt_tokens"])
    assert http["prefix_cache_hit_rate"] is not None
    assert result.extra["http_over_in_process"]["mean_e2el_ms"] > 0


def test_startup_figures(runs: dict[str, tuple[Result, str]]) -> None:
    result, _ = runs["startup"]
    assert [case.name for case in result.cases] == ["help", "generate"]
    assert all(positive(case.figures["median_s"]) for case in result.cases)
    phases = {(row["track"], row["phase"]) for row in result.extra["timeline"]}
    assert {
        ("startup", "imports"),
        ("core_startup", "load_model"),
        ("device", "first step"),
    } <= phases


def test_serve_against_a_server_running_elsewhere(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--base-url``: the load goes to that server (its name sent with
    ``--served-model``); nothing is started."""
    engine = ["--load-format", "dummy", "--model", "tiny-llama", "--no-engine-process"]
    argv = [sys.executable, "-m", "asyncstep", "serve", *engine, "--port", "0"]
    proc = subprocess.Popen(
        [*argv, "--served-model-name", "tiny"], stdout=subprocess.PIPE, text=True
    )
    try:
        url = serving_url(proc, [])
        out = tmp_path / "serve.json"
        load = ["--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--num-warmups", "0"]
        load += ["--output-json", str(out)]
        code = main(["bench", "serve", "--base-url", url, "--served-model", "tiny", *engine, *load])
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert code == 0, capsys.readouterr().err
    result = decode(out.read_bytes())
    (case,) = result.cases
    assert case.figures["completed"] == 3 and case.figures["output_throughput"]
    assert result.extra["base_url"] == url
    assert "asyncstep serve ready" not in capsys.readouterr().err  # none started here


@pytest.mark.parametrize("mode", ["latency", "throughput", "serve", "startup"])
def test_help_lists_every_engine_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", mode, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    flags = [engine_flag(name) for name in engine_options() if name not in DERIVED_OPTIONS]
    if mode == "serve":
        flags += [engine_flag(name) for name in server_options()]
    missing = [flag for flag in flags if not re.search(rf"^\s+{flag}[ ,]", text, re.M)]
    assert missing == []
    assert "--output-json" in text and text.startswith(f"usage: asyncstep bench {mode}")


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["latency", "--bogus"], 1, "unrecognized arguments: --bogus"),
        (["nosuch"], 1, "invalid choice: 'nosuch'"),
        (["latency", "--batch-size", "0"], 1, "--batch-size values must be >= 1"),
        (["latency", "--num-iters", "x"], 1, "invalid int value: 'x'"),
        (["latency", "--block-size", "3"], 1, "block_size must be a power of two"),
        (["latency", "--load-format", "dummy", "--model", "nope"], 1, "known: tiny-llama"),
        (["serve", "--goodput", "ttft=5"], 1, "--goodput takes KEY:MS"),
        (["serve", "--prefix-len", "-1"], 1, "--prefix-len must be >= 0, got -1"),
        (["serve", "--data-parallel-size", "0"], 1, "data_parallel_size must be in [1, 64]"),
        (["startup", "--load-format", "dummy", "--model", "tiny-llama", "--cases", "x"], 1, "x"),
    ],
)
def test_a_bad_flag_is_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], status: int, message: str
) -> None:
    try:
        code = main(["bench", *argv])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    assert code == status and out == ""
    assert err.startswith("asyncstep") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_engine_flags_given_win_over_the_sizing() -> None:
    argv = ["latency", "--load-format", "dummy", "--model", "tiny-llama", "--max-num-seqs", "3"]
    bench = parse_bench_args([*argv, "--batch-size", "8", "--tp", "1"], FLAGS)
    assert bench.given == {"max_num_seqs", "load_format", "model", "tensor_parallel_size"}
    config = bench.engine_config(max_num_seqs=8, max_model_len=64)
    assert config.scheduler.max_num_seqs == 3 and config.model.max_model_len == 64
    assert bench.engine_argv == [*argv[1:], "--tp", "1"]
    assert "batch_size" in bench.options() and "max_num_seqs" not in bench.options()


@pytest.mark.parametrize("shape", ["tiny-llama", "gpt-oss-20b", "gemma3-1b"])
def test_the_latency_sizing_holds_a_request_in_every_kv_cache_group(shape: str) -> None:
    """Batch 1 of 128 + 64 tokens: the KV cache ``bench latency`` sizes holds
    the request in each of the model's KV cache groups (gpt-oss 2, Gemma 3
    13; one group before, a windowed model's prompt did not fit)."""
    argv = ["latency", "--load-format", "dummy", "--model", shape, "--output-len", "64"]
    bench = parse_bench_args(argv, FLAGS)
    sized = latency.sizing(bench, [(1, 128)])
    groups = kv_cache_groups(get_shape(shape).layer_windows)
    block_size = bench.engine_config().cache.block_size
    manager = make_kv_cache_manager(sized["num_blocks"], block_size, groups=groups)
    assert manager.token_capacity >= sized["max_model_len"] >= 128 + 64


def test_floor_matches_anchors() -> None:
    """Weight bytes (bf16) as in anchors.md: llama-1b 2.47 GB, llama-8b 16.06 GB;
    the floor at batch 1 at 4.15 TB/s about 0.59 / 3.85 ms (KV term included)."""
    for shape, gb, floor_ms in (("llama-1b", 2.47, 0.59), ("llama-8b", 16.06, 3.85)):
        arch = get_shape(shape)
        weights, embed = weight_bytes(arch, 2)
        assert round(weights / 1e9, 2) == gb
        assert (embed == 0) == arch.tie_word_embeddings
        floor = step_floor(arch, 2, 4.15e12, 1, 128 + 64)
        assert floor["floor_ms"] == pytest.approx(floor_ms, rel=0.02)
        assert floor["strict_floor_ms"] <= floor["floor_ms"]


def test_the_floor_counts_the_bytes_the_model_reads() -> None:
    """With the engine's report: a packed layer's bytes in a step small
    enough for it, its dense bytes above, one embedding row a token; the
    throughput floor at the number of requests still decoding, step by step."""
    arch = get_shape("tiny-llama")
    reads = WeightReads(1000, [PackedReads(2, 100, 400)], embedding_row_bytes=10)
    kv = kv_bytes_per_token(arch, 2)
    for batch, weights in ((1, 1000 + 100 + 10), (2, 1000 + 100 + 20), (3, 1000 + 400 + 30)):
        floor = step_floor(arch, 2, 1e9, batch, 16, reads=reads)
        assert floor["weight_bytes"] == weights and floor["kv_bytes"] == batch * 16 * kv
        assert floor["floor_ms"] == pytest.approx((weights + batch * 16 * kv) / 1e9 * 1e3)
        assert floor["strict_floor_ms"] == floor["floor_ms"]
    # Outputs of 1, 3 and 4 tokens: step 1 runs 3 requests, steps 2-3 two, step 4 one.
    run = throughput_floor(arch, 2, 1e9, [5, 5, 5], [1, 3, 4], reads=reads)
    weights = 1430 + 2 * 1120 + 1110
    contexts = 1 * 5.5 + 3 * 6.5 + 4 * 7
    assert run["run_weight_bytes"] == weights and run["weight_bytes"] == 1430
    assert run["floor_s"] == pytest.approx((weights + contexts * kv) / 1e9)
    # Without it (--floor-only): every weight dense at every step, as before.
    dense = throughput_floor(arch, 2, 1e9, [5, 5, 5], [1, 3, 4])
    assert dense["run_weight_bytes"] == 4 * weight_bytes(arch, 2)[0]


def test_rank_gpus_keep_every_communicator_on_distinct_gpus() -> None:
    assert rank_gpus(2, 2, 4) == [0, 1, 2, 3]  # enough GPUs: one each
    assert rank_gpus(2, 2, 2) == [0, 1, 1, 0]  # TP groups {0,1} {2,3}, PP groups {0,2} {1,3}
    eight_on_four = rank_gpus(4, 2, 4)
    assert [eight_on_four[r] for r in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [eight_on_four[r] for r in (4, 5, 6, 7)] == [1, 2, 3, 0]
    with pytest.raises(ValueError, match=r"ranks \[0, 2, 4\] .*needs at least 3 GPUs"):
        rank_gpus(2, 3, 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        rank_gpus(2, 2, 0)


def _run_module(name: str, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python3 -m asyncstep.bench.NAME ARGV``."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", f"asyncstep.bench.{name}", *argv],
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
    proc = _run_module("pp_transfer", *argv, "--warmup", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = decode(out.read_bytes())
    assert result.mode == "pp_transfer" and result.extra["layout"]["tp"] == 2
    cases = result.cases
    assert {(c.params["tokens"], c.params["mode"]) for c in cases} == {
        (t, m)
        for t in (1, 8)
        for m in ("lane", "whole", "lane_raw", "whole_raw", "gather_raw", "meta_raw")
    }
    assert all(c.detail["correct"] and (c.figures["one_way_us"] or 0) > 0 for c in cases)
    eight = next(c for c in cases if c.params["tokens"] == 8)
    assert eight.figures["bytes"] == 2 * 8 * 64 * 4  # two fp32 keys


def test_layout_tokens_with_ranks_started_outside_the_engine(tmp_path: Path) -> None:
    """The issue-6 check on the CPU: PP = 2 x TP = 2, ranks started by the
    script (``--rank-gpus``, the engine waits for them), tokens = one rank's."""
    out = tmp_path / "tokens.json"
    argv = ["--model", "tiny-llama", "--device", "cpu", "--rank-gpus", "2"]
    argv += ["--max-tokens", "6", "--prompt-lens", "3", "20", "--out", str(out)]
    proc = _run_module("layout_tokens", *argv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = decode(out.read_bytes())
    runs = {c.name: c for c in result.cases}
    assert result.extra["all_equal"] and set(runs) == {"single_rank", "overlap_on", "overlap_off"}
    reference = runs["single_rank"].detail
    assert reference["probe"]["output_changes"]  # the check can see the context
    assert all(len(t) == 6 for t in reference["tokens"])
    assert all(runs[name].detail["equal"] for name in ("overlap_on", "overlap_off"))


def test_a_shared_prefix_workload_and_its_hit_rate() -> None:
    from asyncstep.bench.serve import prefix_cache_figures
    from asyncstep.bench.workload import workload

    load = workload(1000, 40, 5, 3, prefix_len=8, num_prefixes=4, seed=1)
    heads = {tuple(r.prompt[:8]) for r in load}
    assert len(heads) == 4 and all(len(r.prompt) == 13 for r in load)
    assert len({tuple(r.prompt[8:]) for r in load}) == 40
    before = {("0", "hits"): 10.0, ("0", "queries"): 20.0, ("all", "hits"): 10.0}
    before[("all", "queries")] = 20.0
    after = {("0", "hits"): 40.0, ("0", "queries"): 60.0, ("all", "hits"): 40.0}
    after[("all", "queries")] = 60.0
    figures = prefix_cache_figures(before, after)
    assert figures["prefix_cache_hit_rate"] == 0.75 and figures["replica_0_hit_rate"] == 0.75
    assert figures["replica_0_prompt_tokens"] == 40.0


class _LateAndCoalesced:
    """An engine stand-in: the first request streams a token at a time, then
    the second request's whole output comes in one chunk (its consumer was
    slower than the steps), so no token comes after the last first token."""

    def __init__(self) -> None:
        self.turn = trio.Lock()
        self.served = 0

    async def stream(self, prompt: list[int], params: Any) -> Any:
        async with self.turn:
            self.served += 1
            if self.served == 1:
                for token in range(params.max_tokens):
                    await trio.lowlevel.checkpoint()
                    yield SimpleNamespace(token_ids=[token])
            else:
                yield SimpleNamespace(token_ids=list(range(params.max_tokens)))


def test_itl_falls_back_to_whole_outputs_when_no_token_comes_after_the_last_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ticks = itertools.count()  # the bench's clock: one second a reading
    monkeypatch.setattr(latency, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    row = trio.run(stream_batch, _LateAndCoalesced(), [[1], [2]], 4)
    # The first request's tokens came a second apart; the coalesced output
    # has no gap to time and is left out.
    assert row["itl_ms"] == row["itl_all_ms"] == 1000.0
