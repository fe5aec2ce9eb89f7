"""The OpenMP threads of a CPU rank.

A CPU rank's steps run on its launch thread with ``cpu_threads`` torch
threads, and that thread alone may keep OpenMP threads: each thread that ran
a multi-threaded torch op keeps a pool of its own until it ends, and libgomp
spins between parallel regions only while the threads it manages fit the
cores. With a second pool every op of a step waits for its helpers to wake
from a futex. So the work before the steps (loading, the KV cache) runs in
:func:`run_in_ending_thread`. Imports anyio only.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import anyio

T = TypeVar("T")


async def run_in_ending_thread(fn: Callable[[], T], name: str = "asyncstep-setup") -> T:
    """``fn()`` in a new thread that has ended when this returns (its OpenMP
    threads with it); not cancellable, as a worker thread of anyio's is not."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        return await anyio.to_thread.run_sync(pool.submit(fn).result)
    finally:
        pool.shutdown(wait=True)
