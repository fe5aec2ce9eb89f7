"""Cold start: the caller's side of asyncstep imports no torch (the engine
core, in its own process, is the one that needs it), so ``import asyncstep``
and ``asyncstep --help`` stay fast."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
