"""Triton kernels compiled for Hopper (sm_90) with no GPU: a fresh process
without ``TRITON_INTERPRET`` runs a script that compiles them with triton's
own ptxas (the interpreter runs code the compiler may refuse)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def compile_for_sm90(script: str, tmp_path: Path) -> list[str]:
    """``script``'s printed words, run in a fresh process (its Triton cache
    in ``tmp_path``); skipped where triton has no CUDA backend, failed with
    the script's error where it does not compile."""
    pytest.importorskip("triton.backends.nvidia", reason="triton's CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()
