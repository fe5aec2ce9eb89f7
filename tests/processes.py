"""Whether another process still lives, for the tests that check that none
is left behind (engine cores, ranks, API servers), and polling another
process under a deadline. Standard library only."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` is gone within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)  # a test polling another process, not a trio task
    return not alive(pid)


def wait_for(check: Callable[[], T], what: str, timeout_s: float = 30) -> T:
    """Poll ``check`` until it returns something true, else AssertionError
    after ``timeout_s`` seconds (a test thread polling another process)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)  # a test polling another process, not a trio task
