"""Cold start: the caller's side of asyncstep imports no torch (the engine
core, in its own process, is the one that needs it), so ``import asyncstep``
and ``asyncstep --help`` stay fast; the start-up timeline is logged; the
host KV cache costs nothing to clear."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncstep.logging.spans import CORE_STARTUP, STARTUP
from asyncstep.logging.trace import load_spans
from asyncstep.runner.kv_sizing import zeroed_host_tensors

CHECK = "import sys; {}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"


@pytest.mark.parametrize(
    "statement",
    ["import asyncstep", "import asyncstep.cli", "import asyncstep.server.app"],
)
def test_the_front_end_imports_no_torch(statement: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(statement)], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_help_imports_no_torch() -> None:
    code = (
        "import sys, runpy; sys.argv = ['asyncstep', '--help']\n"
        "try:\n    runpy.run_module('asyncstep', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('LOADED', 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage" in done.stdout and "LOADED False" in done.stdout, done.stdout[-500:]


def test_the_front_end_describes_the_model_without_torch() -> None:
    """Layout check and model description, as ``open_engine`` does them
    before the engine-core child starts, import no torch (a torch built
    without CUDA answers ``device_type("auto")`` unimported)."""
    code = (
        "import sys\n"
        "from asyncstep.config import ModelConfig\n"
        "from asyncstep.models.model_info import _torch_has_gpu_build, device_type, model_arch\n"
        "arch, _ = model_arch(ModelConfig())\n"
        "gpu = _torch_has_gpu_build()\n"
        "kind = device_type('cpu') if gpu else device_type('auto')\n"
        "print(arch.num_hidden_layers, kind, gpu, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    layers, kind, _, loaded = done.stdout.split()
    assert (layers, kind, loaded) == ("30", "cpu", "False"), done.stdout


def test_generate_logs_a_start_up_timeline(tmp_path: Path) -> None:
    """``--log-json`` holds each process's start-up spans: the front end's
    imports and tokenizer, the engine core's imports, weights and KV cache."""
    log = tmp_path / "run.jsonl"
    argv = [sys.executable, "-m", "asyncstep", "generate", "Hi", "--max-tokens", "2"]
    done = subprocess.run(
        [*argv, "--log-json", str(log)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    spans = load_spans(tmp_path.glob("run.jsonl*"))
    names = {(s.task, s.name) for s in spans if s.task in (STARTUP, CORE_STARTUP)}
    for task, name in [
        (STARTUP, "imports"),
        (STARTUP, "tokenizer"),
        (CORE_STARTUP, "imports"),
        (CORE_STARTUP, "load_model"),
        (CORE_STARTUP, "kv_cache"),
    ]:
        assert (task, name) in names, sorted(names)
    assert all(s.dur_us >= 0 for s in spans)


def test_a_host_kv_cache_is_zeroed_without_writing_it() -> None:
    shapes = [(3, 2, 16, 4), (5, 2, 16, 8)]
    first, second = zeroed_host_tensors(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in (first, second)] == shapes
    assert first.dtype == second.dtype == torch.bfloat16
    assert not first.any() and not second.any()
    first.fill_(1)
    assert not second.any()  # separate memory
    assert first.data_ptr() % 2 == 0 and second.data_ptr() % 2 == 0


def test_a_front_end_serves_the_embedded_model_without_torch() -> None:
    """``open_engine`` (the engine core in its own process) loads the
    tokenizer, renders the chat template and streams an answer without
    importing torch in the caller's process (importing it costs the caller
    a second at start and a core while the child imports its own)."""
    code = (
        "import sys, trio, asyncstep\n"
        "async def main():\n"
        "    async with asyncstep.open_engine() as engine:\n"
        "        params = asyncstep.SamplingParams(temperature=0, max_tokens=4)\n"
        "        chat = [{'role': 'user', 'content': 'Hi'}]\n"
        "        chunks = [c async for c in engine.stream(chat, params)]\n"
        "    print(len(chunks) > 0, 'torch' in sys.modules)\n"
        "trio.run(main)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "False"], done.stdout
