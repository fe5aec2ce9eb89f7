"""Whether another process still lives, for the tests that check that none
is left behind (engine cores, ranks, API servers), and polling another
process under a deadline, and the URL of an ``asyncstep serve`` child.
Standard library only."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
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


def serving_url(proc: subprocess.Popen[str], output: list[str], timeout_s: float = 120) -> str:
    """The URL an ``asyncstep serve`` subprocess (stdout piped, text) prints
    once it serves; its lines are appended to ``output`` on a thread until
    it exits. Kills it and raises AssertionError after ``timeout_s``."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise AssertionError("the server did not start:\n" + "".join(output)) from None
        if line.startswith("asyncstep: serving"):
            return line.split(" on ")[-1].strip()
