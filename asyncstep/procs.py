"""Process helpers shared by the engine-core and rank entries: a child that
never outlives its parent, how a child's exit is told, and a quick exit for
a process whose work is done. Standard library only.

A parent keeps the write end of its child's stdin pipe open and never writes
to it; the kernel closes it when the parent dies, however it dies (SIGKILL
included). The child watches for that end of file on a thread of its own, so
it notices even while its event loop or a collective is stuck. (The kernel's
``PR_SET_PDEATHSIG`` is no substitute: it fires when the parent *thread* that
spawned the child ends, and Trio spawns from a worker thread that retires
after a few idle seconds.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn


def exit_when_parent_dies(grace_s: float, fd: int = 0) -> threading.Thread:
    """Watch ``fd`` (stdin: a pipe from the parent) on a daemon thread; at its
    end of file wait ``grace_s`` seconds (time to shut down in order, which the
    closed connection to the parent also starts), then end the process."""

    def watch() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        time.sleep(grace_s)
        sys.stderr.flush()
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def exit_reason(code: int) -> str:
    """How a child ended, from its return code, in words."""
    if code < 0:
        return f"died (killed by signal {signal.Signals(-code).name})"
    return f"exited with status {code}"


def exit_now(status: int) -> NoReturn:
    """End this process with ``status`` once its output is flushed, without
    the interpreter's teardown (with torch and transformers loaded, an
    unloading that nobody waits for). Only for an entry point's last
    line, after its own orderly shutdown: atexit handlers do not run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader went away
            stream.flush()
    os._exit(status)
