"""The command line: the main job on the embedded model, JSON output, stdin
prompts, and a clear one-line error (exit 1, no traceback) for each bad input."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncstep.cli import main
from asyncstep.models.loader import open_checkpoint


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_main_job_answers_paris(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "generate", "What is the capital of France?", "--max-tokens", "32")
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
    events = [json.loads(line) for line in log_file.read_text().splitlines()]
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
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncstep",
            "generate",
            "--model",
            str(tiny_hf_dir),
            "--no-chat",
            "--max-tokens",
            "100000",
            "--ignore-eos",
            "--max-model-len",
            "512",
            "Once upon a time",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.read(1)  # generation has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert b"asyncstep: interrupted" in err and b"Traceback" not in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cudagraph-mode", "always"], "invalid choice: 'ALWAYS'"),
        (["--attention-backend", "flash"], "invalid choice: 'flash'"),
    ],
)
def test_bad_fast_path_options(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["generate", *args, "x"])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_pipeline_tensor_lanes_flag() -> None:
    from asyncstep.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).pp_tensor_lanes is True
    assert parser.parse_args(["generate", "hi", "--no-pp-tensor-lanes"]).pp_tensor_lanes is False
