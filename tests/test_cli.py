"""The command line: the main job on the embedded model, JSON output, stdin
prompts, and a clear one-line error (exit 1, no traceback) for each bad input."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncstep.cli import (
    DERIVED_OPTIONS,
    build_parser,
    config_from_args,
    engine_flag,
    main,
)
from asyncstep.config import EngineConfig, engine_options
from asyncstep.engine.front_end.api import make_config
from asyncstep.logging import shown_path
from asyncstep.models.loader import open_checkpoint
from asyncstep.ops.cpu.library import CACHE_ENV, SWITCH_ENVS


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flags", [(), ("--dtype", "bfloat16")], ids=["default", "bfloat16"])
def test_main_job_answers_paris(capsys: pytest.CaptureFixture[str], flags: tuple[str, ...]) -> None:
    """The README's main job, with no flag, and with bfloat16 (the default of
    AVX512-BF16 / AMX CPUs before; forced here so that every CPU runs it)."""
    flags = ("--max-tokens", "32", *flags)
    code, out, err = run(capsys, "generate", "What is the capital of France?", *flags)
    assert code == 0, err
    assert "Paris" in out


def test_json_no_chat_stdin_and_log_json(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tiny_hf_dir: Path,
    tmp_path: Path,
) -> None:
    prompts = ["Hello there", "The quick brown fox"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(prompts) + "\n\n"))
    log_file = tmp_path / "steps.jsonl"
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(tiny_hf_dir),
        "--no-chat",
        "--json",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--log-json",
        str(log_file),
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    tokenizer = open_checkpoint(tiny_hf_dir).load_tokenizer()
    assert [r["prompt"] for r in records] == prompts
    for r in records:
        assert r["prompt_token_ids"] == tokenizer(r["prompt"]).input_ids
        assert len(r["token_ids"]) == 5 and r["finish_reason"] == "length"
        assert r["text"] == tokenizer.decode(r["token_ids"], skip_special_tokens=True)
    # The step events come from the engine core, a process of its own: FILE.core.
    lines = log_file.read_text().splitlines() + Path(f"{log_file}.core").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert any(e["event"] == "step" and e["num_tokens"] > 0 for e in events)


def test_chat_is_the_default_when_the_tokenizer_has_a_template(
    capsys: pytest.CaptureFixture[str], tiny_hf_dir: Path
) -> None:
    code, out, _ = run(
        capsys, "generate", "--model", str(tiny_hf_dir), "--json", "--max-tokens", "2", "Hi"
    )
    assert code == 0
    record = json.loads(out)
    tokenizer = open_checkpoint(tiny_hf_dir).load_tokenizer()
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert record["prompt_token_ids"] == tokenizer(templated, add_special_tokens=False).input_ids


def test_n_choices_print_and_travel_in_json(
    capsys: pytest.CaptureFixture[str], tiny_hf_dir: Path
) -> None:
    args = ["--model", str(tiny_hf_dir), "--no-chat", "--max-tokens", "3", "--ignore-eos"]
    sampled = ["--n", "3", "--temperature", "0.9", "--seed", "5"]
    code, out, _ = run(capsys, "generate", *args, *sampled, "--json", "Hi")
    assert code == 0
    record = json.loads(out)
    assert [o["index"] for o in record["outputs"]] == [0, 1, 2]
    assert record["token_ids"] == record["outputs"][0]["token_ids"]
    code, out, _ = run(capsys, "generate", *args, *sampled, "Hi")
    assert code == 0 and out.count("\n") >= 6  # every choice's text on its own line(s)
    assert [line for line in out.splitlines() if line.startswith("--- choice")] == [
        "--- choice 0 ---",
        "--- choice 1 ---",
        "--- choice 2 ---",
    ]
    code, _, err = run(capsys, "generate", *args, "--n", "0", "Hi")
    assert code != 0 and "n must be an integer in [1, 128], got 0" in err


def test_structured_output_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    question = "What is the capital of France? Answer in JSON."
    flags = ["--json-schema", str(tmp_path / "schema.json"), "--json", "--max-tokens", "32"]
    code, out, err = run(capsys, "generate", *flags, question)
    assert code == 0, err
    record = json.loads(out)
    assert record["finish_reason"] == "stop" and "city" in json.loads(record["text"])
    choices = ["--choice", "Paris", "--choice", "London", "--n", "2", "--temperature", "0.8"]
    code, out, err = run(capsys, "generate", *choices, "--seed", "1", "--json", question)
    assert code == 0, err
    assert {o["text"] for o in json.loads(out)["outputs"]} <= {"Paris", "London"}


def write_config(directory: Path, **config: object) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


LLAMA_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=64,
    hidden_size=36,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-tokens", "0", "x"], "max_tokens must be at least 1"),
        (["--temperature", "-0.5", "x"], "temperature must be a finite number >= 0"),
        (["--top-p", "0", "x"], "top_p must be in (0, 1]"),
        (["--top-p", "1.5", "x"], "top_p must be in (0, 1]"),
        (["--top-k", "-2", "x"], "top_k must be >= 1, or 0 / -1"),
        (["--min-p", "1.5", "x"], "min_p must be in [0, 1]"),
        (["--model", "/no/such/model.gguf", "x"], "model not found"),
        (["--max-model-len", "0", "x"], "max_model_len must be positive"),
        (["--device", "tpu", "x"], "device must be"),
        (["--max-concurrent-batches", "-1", "x"], "max_concurrent_batches must be 0"),
        (["--block-size", "3", "x"], "block_size must be a power of two, got 3"),
        (["--gpu-memory-utilization", "2", "x"], "gpu_memory_utilization must be in (0, 1]"),
        (["--num-blocks", "0", "x"], "num_blocks must be positive, got 0"),
        (["--listen", "nowhere", "x"], "listen must be HOST:PORT, got 'nowhere'"),
        (["--cudagraph-capture-sizes", "0", "8", "--ignore-eos", "x"], "capture_sizes must be"),
        (["--regex", "[a-", "x"], "structured_outputs.regex does not compile: Regex parsing"),
        (["--regex", "a", "--choice", "b", "x"], "exactly one of json, json_object, regex"),
        (["--json-schema", "/no/such/schema.json", "x"], "--json-schema /no/such/schema.json"),
        (["--choice", "", "x"], "choice must not hold an empty string"),
        (["--load-format", "dummy", "--model", "foo", "x"], "known: tiny-llama, smollm2-135m"),
        (["--chat-template", "/no/such.jinja", "x"], "chat_template /no/such.jinja: No such file"),
        (["--load-format", "dummy", "--model", "tiny-llama", "--token-ids", "1 x"], "--token-ids"),
    ],
)
def test_bad_arguments(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run(capsys, "generate", *args)
    assert code == 1 and out == ""
    assert err.startswith("asyncstep: error:") and message in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_bad_model_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    truncated = tmp_path / "truncated.gguf"
    with open(open_checkpoint(None).path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    cases = {
        garbage: "broken.gguf",
        truncated: "truncated.gguf",
        write_config(
            tmp_path / "gpt2", architectures=["GPT2LMHeadModel"]
        ): "unsupported architecture",
        write_config(
            tmp_path / "heads", **{**LLAMA_CONFIG, "num_key_value_heads": 4}
        ): "not a multiple",
    }
    for path, message in cases.items():
        code, _, err = run(capsys, "generate", "--model", str(path), "x")
        assert code == 1 and message in err, err
        assert "Traceback" not in err and err.count("\n") == 1


def test_bad_prompts_fail_alone(capsys: pytest.CaptureFixture[str], tiny_hf_dir: Path) -> None:
    long = "word " * 600
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        str(tiny_hf_dir),
        "--no-chat",
        "--json",
        "--max-tokens",
        "2",
        "fine",
        "",
        long,
    )
    assert code == 1
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records[0]["token_ids"]) == 2
    assert "prompt is empty" in records[1]["error"]
    assert "max_model_len" in records[2]["error"]
    assert err.count("asyncstep: error:") == 2 and "Traceback" not in err


def test_exit_status_and_no_traceback_in_a_real_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncstep", "generate", "--top-p", "2", "hello"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == "asyncstep: error: top_p must be in (0, 1], got 2.0"


def test_ctrl_c_stops_cleanly(tiny_hf_dir: Path) -> None:
    """Ctrl-C while prompts are still being served: 64 prompts of 400 tokens,
    one at a time; the signal comes once the first has printed, with ~25,000
    tokens to go (a single prompt's length could end before the signal).
    The child takes Ctrl-C as a terminal's foreground job does, even when
    this test runs where SIGINT is ignored (a background job of a
    non-interactive shell: a disposition children inherit)."""
    as_foreground = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'asyncstep'; runpy.run_module('asyncstep', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            as_foreground,
            "generate",
            "--model",
            str(tiny_hf_dir),
            "--no-chat",
            "--max-tokens",
            "400",
            "--ignore-eos",
            "--max-num-seqs",
            "1",
            *(f"Once upon a time {i}" for i in range(64)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # the first prompt is done, the others not
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert b"asyncstep: interrupted" in err and b"Traceback" not in err


def test_the_first_run_says_what_it_builds_once(tiny_hf_dir: Path, tmp_path: Path) -> None:
    """The CPU kernels' build and the packed weights' first write (each a
    wait of seconds) are told on stderr: once per engine (two pipeline ranks
    each build both: one line each), and not again once cached."""
    env = {k: v for k, v in os.environ.items() if k not in SWITCH_ENVS}
    env[CACHE_ENV] = str(tmp_path)

    def told(*flags: str) -> list[str]:
        argv = [sys.executable, "-m", "asyncstep", "generate", "--model", str(tiny_hf_dir)]
        argv += ["--weight-packing", "q4", "--max-tokens", "2", *flags, "hi"]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stderr.splitlines() if line.startswith("asyncstep:")]

    kernels_dir, weights_dir = shown_path(tmp_path / "kernels"), shown_path(tmp_path / "weights")
    kernels = f"asyncstep: building the CPU kernels for this machine (once, ~10 s) in {kernels_dir}"
    weights = f"asyncstep: packing the weights for this CPU (once, cached in {weights_dir})"
    assert sorted(told("--pp", "2")) == sorted([kernels, weights])
    assert told("--pp", "2") == []
    assert told() == [weights]  # one rank: an entry of its own; the kernels are built


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cudagraph-mode", "always"], "invalid choice: 'ALWAYS'"),
        (["--attention-backend", "flash"], "invalid choice: 'flash'"),
        (["--block-size", "x"], "invalid int value: 'x'"),
        (["--num-blocks", "many"], "invalid int value: 'many'"),
        (["--cudagraph-capture-sizes", "8", "none", "--json"], "none cannot be mixed with"),
    ],
)
def test_bad_fast_path_options(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", *args, "x"])
    assert exited.value.code == 1 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["generate", "--max-tokens", "abc", "x"],
            "asyncstep generate: error: argument --max-tokens: invalid int value: 'abc'"
            " (run 'asyncstep generate --help' for the options)",
        ),
        (
            ["generate", "--bogus", "x"],
            "asyncstep generate: error: unrecognized arguments: --bogus"
            " (run 'asyncstep generate --help' for the options)",
        ),
        (
            ["serve", "--attention-backend", "flash"],
            "asyncstep serve: error: argument --attention-backend: invalid choice: 'flash'"
            " (choose from 'auto', 'torch', 'triton', 'cpu')"
            " (run 'asyncstep serve --help' for the options)",
        ),
        (
            ["trace", "log.jsonl"],
            "asyncstep trace: error: the following arguments are required: -o/--output"
            " (run 'asyncstep trace --help' for the options)",
        ),
        (
            ["bench", "latency", "--num-iters", "x"],
            "asyncstep bench latency: error: argument --num-iters: invalid int value: 'x'"
            " (run 'asyncstep bench latency --help' for the options)",
        ),
        (
            ["nosuch"],
            "asyncstep: error: argument command: invalid choice: 'nosuch' (choose from"
            " 'generate', 'trace', 'bench', 'serve') (run 'asyncstep --help' for the commands)",
        ),
    ],
)
def test_an_argument_error_is_one_line_and_status_1(
    capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    """Not argparse's whole usage and status 2: the error and where the
    options are, on one line, and status 1, as every other error."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 1 and out == ""
    assert err == line + "\n"


def test_help_is_still_argparse_s(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--help"])
    out, err = capsys.readouterr()
    assert exited.value.code == 0 and err == ""
    assert out.startswith("usage: asyncstep generate") and "--max-tokens" in out


def test_pipeline_tensor_lanes_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).pp_tensor_lanes is True
    assert parser.parse_args(["generate", "hi", "--no-pp-tensor-lanes"]).pp_tensor_lanes is False


# -- engine flags, derived from the config's fields ------------------------------------

#: A value other than the default for every option the CLI has a flag for:
#: (the flag's arguments, the value make_config gets).
SAMPLES: dict[str, tuple[list[str], object]] = {
    "model": (["/models/x.gguf"], "/models/x.gguf"),
    "load_format": (["dummy"], "dummy"),
    "dtype": (["bfloat16"], "bfloat16"),
    "weight_packing": (["none"], "none"),
    "packed_max_tokens": (["4"], 4),
    "batch_invariant": ([], False),
    "packed_weight_cache": ([], False),
    "chat_template": (["/t.jinja"], "/t.jinja"),
    "device": (["cuda:1"], "cuda:1"),
    "max_model_len": (["512"], 512),
    "seed": (["7"], 7),
    "block_size": (["32"], 32),
    "num_blocks": (["100"], 100),
    "kv_cache_memory_gib": (["2.5"], 2.5),
    "gpu_memory_utilization": (["0.5"], 0.5),
    "enable_prefix_caching": ([], False),
    "max_num_batched_tokens": (["512"], 512),
    "max_num_seqs": (["8"], 8),
    "enable_chunked_prefill": ([], False),
    "async_scheduling": ([], False),
    "max_concurrent_batches": (["3"], 3),
    "gil_switch_interval_s": (["none"], None),
    "tensor_parallel_size": (["2"], 2),
    "pipeline_parallel_size": (["2"], 2),
    "sequence_parallel": ([], True),
    "enable_expert_parallel": ([], True),
    "launch_ranks": ([], False),
    "listen": (["0.0.0.0:5555"], "0.0.0.0:5555"),
    "pp_tensor_lanes": ([], False),
    "engine_process": ([], False),
    "cpu_threads": (["3"], 3),
    "data_parallel_size": (["2"], 2),
    "data_parallel_routing": (["round-robin"], "round-robin"),
    "data_parallel_balance_threshold": (["8"], 8),
    "data_parallel_rank": (["0"], 0),
    "cudagraph_mode": (["piecewise"], "PIECEWISE"),
    "cudagraph_capture_sizes": (["1", "2", "8"], [1, 2, 8]),
    "max_cudagraph_capture_size": (["64"], 64),
    "attention_backend": (["torch"], "torch"),
    "fused_kernels": ([], False),
    "fused_decode": ([], False),
    "gpu_q4_activations": (["int8"], "int8"),
    "greedy_in_graph": ([], False),
    "enable_ubatching": ([], True),
    "ubatch_decode_threshold": (["16"], 16),
    "ubatch_prefill_threshold": (["256"], 256),
    "cudagraph_stand_in": ([], True),
    "launch_inline": ([], True),
    "grammar_max_bytes": (["1024"], 1024),
    "grammar_max_alternatives": (["16"], 16),
    "grammar_max_properties": (["64"], 64),
    "grammar_max_depth": (["8"], 8),
    "grammar_compile_workers": (["2"], 2),
    "grammar_compile_idle_s": (["300"], 300.0),
    "grammar_compile_timeout_s": (["2.5"], 2.5),
    "grammar_compile_memory_mib": (["512"], 512),
    "grammar_cache_mib": (["0"], 0),
    "reasoning_parser": (["deepseek_r1"], "deepseek_r1"),
    "speculative_config": (['{"num_speculative_tokens": 3}'], {"num_speculative_tokens": 3}),
}


def config_of(*flags: str) -> EngineConfig:
    return config_from_args(build_parser().parse_args(["generate", "hi", *flags]))


def test_every_engine_option_is_a_flag() -> None:
    options = engine_options()
    assert set(SAMPLES) == set(options) - DERIVED_OPTIONS
    assert config_of() == make_config()  # the flags' defaults are the config's
    for name, (values, value) in SAMPLES.items():
        option = options[name]
        flag = engine_flag(name)
        if option.value_type is bool:  # --x / --no-x
            flag = flag if value else "--no-" + flag[2:]
        assert option.default != value, name
        assert config_of(flag, *values) == make_config(**{name: value}), name


@pytest.mark.parametrize(
    "flags,options",
    [
        (["--tp", "2", "--pp", "3"], {"tensor_parallel_size": 2, "pipeline_parallel_size": 3}),
        (["--kv-cache-memory", "2"], {"kv_cache_memory_gib": 2.0}),
        (["--no-overlap"], {"async_scheduling": False}),
        (["--no-overlap", "--overlap"], {}),
        (["--ubatching"], {"enable_ubatching": True}),
        (
            ["--external-ranks", "--listen", "0.0.0.0:5555"],
            {"launch_ranks": False, "listen": "0.0.0.0:5555"},
        ),
        (["--no-pp-tensor-lanes"], {"pp_tensor_lanes": False}),
        (["--max-concurrent-batches", "3"], {"max_concurrent_batches": 3}),
        (["--engine-seed", "3", "--seed", "5"], {"seed": 3}),  # --seed: sampling
        (["--num-blocks", "None", "--model", "none"], {}),
        (["--cudagraph-capture-sizes", "none"], {}),
        (
            ["-vv", "--log-json", "log.jsonl"],
            {"rank_log_level": "debug", "rank_log_json": "log.jsonl"},
        ),
    ],
)
def test_flag_aliases_and_none(flags: list[str], options: dict[str, object]) -> None:
    assert config_of(*flags) == make_config(**options)


def test_help_shows_each_engine_option_and_its_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--help"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for option in engine_options().values():
        if option.name in DERIVED_OPTIONS:
            continue
        flag = engine_flag(option.name)
        (at,) = [i for i, li in enumerate(lines) if re.match(rf"\s+{flag}[ ,]", li + " ")]
        entry = " ".join(lines[at : at + 2])  # a long invocation puts its help below
        default = option.default
        shown = ("on" if default else "off") if isinstance(default, bool) else str(default)
        shown = "none" if default is None else shown
        assert f"{option.description} (default: {shown})" in entry, entry


#: A long flag quoted in text (``--no-`` alone is not one).
FLAG = r"(?<![\w-])--[a-z](?:[a-z0-9-]*[a-z0-9])?(?![\w-])"


def test_every_flag_the_docs_quote_exists() -> None:
    page = (Path(__file__).parents[1] / "docs" / "cli.md").read_text()
    section = page.split("## `asyncstep generate`'s options", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    quoted = {f for row in rows for f in re.findall(FLAG, row)}
    assert {"--tp", "--block-size", "--overlap", "--no-overlap"} <= quoted
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]  # type: ignore[union-attr]
    known = {flag for action in gen._actions for flag in action.option_strings}
    assert quoted - known == set()


def test_a_model_without_a_tokenizer_takes_and_shows_token_ids(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--load-format", "dummy", "--model", "tiny-llama", "--max-tokens", "3", "--ignore-eos"]
    code, out, err = run(capsys, "generate", *args, "--token-ids", "1 2 3", "4,5")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(len(line.split()) == 3 for line in lines)
    assert all(0 <= int(t) < 512 for line in lines for t in line.split())
    code, _, err = run(capsys, "generate", *args, "hi")
    assert code == 1 and "no tokenizer" in err


def test_max_tokens_past_the_context_is_refused_and_none_fills_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not cut to the context in silence: one line naming the numbers,
    status 1 (the default, 256, too); ``--max-tokens none``: what it leaves."""
    args = ["--load-format", "dummy", "--model", "tiny-llama", "--max-model-len", "64"]
    code, out, err = run(capsys, "generate", *args, "--token-ids", "1 2 3")
    assert code == 1 and out == ""
    assert err == (
        "asyncstep: error: prompt '1 2 3': max_tokens 256 does not fit: the prompt has 3 "
        "tokens and the model's context (max_model_len) is 64, which leaves 61: ask for at "
        "most 61\n"
    )
    fill = ["--max-tokens", "none", "--ignore-eos", "--token-ids", "1 2 3"]
    code, out, err = run(capsys, "generate", *args, *fill)
    assert code == 0 and len(out.split()) == 61, err


def test_help_shows_the_sampling_defaults_and_where_spans_go(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("none: what the context leaves (default: 256)", "0 is greedy (default: 0)"):
        assert shown in text
    assert "FILE.core" in text and "asyncstep trace FILE FILE.*" in text


def test_a_terminal_without_prompts_is_told_what_to_do(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stdin", Terminal(""))
    code, _, err = run(capsys, "generate", "--load-format", "dummy", "--model", "tiny-llama")
    assert code == 1
    assert err.splitlines() == [
        "asyncstep: reading prompts, one a line; Ctrl-D ends",
        "asyncstep: error: no prompts: pass them as arguments or on stdin",
    ]


def test_verbose_says_which_model_was_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys,
        "generate",
        "-v",
        "--load-format",
        "dummy",
        "--model",
        "tiny-llama",
        "--no-engine-process",
        "--token-ids",
        "--max-tokens",
        "1",
        "1 2",
    )
    assert code == 0
    [line] = [line for line in err.splitlines() if "model loaded" in line]
    for part in ("source=tiny-llama", "device=cpu", "dtype=", "layers=4"):
        assert part in line


def test_a_chat_template_file_replaces_the_tokenizer_s(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    code, out, err = run(
        capsys, "generate", "--chat-template", str(template), "--json", "--max-tokens", "1", "Hi"
    )
    assert code == 0, err
    # The file's template: no system prompt (the embedded tokenizer's adds ~20 tokens).
    assert 0 < len(json.loads(out)["prompt_token_ids"]) < 12
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ unclosed")
    code, _, err = run(capsys, "generate", "--chat-template", str(broken), "x")
    assert code == 1 and "does not render a chat" in err and err.count("\n") == 1
    silent = tmp_path / "silent.jinja"
    silent.write_text("nothing of the messages")
    code, _, err = run(capsys, "generate", "--chat-template", str(silent), "x")
    assert code == 1 and "leaves the messages out" in err
