"""Torch threads of a CPU rank's steps.

A step of at most ``small_step_tokens`` tokens (a decode of a few requests)
runs on ``small_steps`` threads, a larger one on ``steps``. On a small
machine the small steps take one: they are a chain of short ops, each of
which a second thread would join and leave, and that core is the one the
front end and the engine's loop run on (a thread the OS deschedules stalls
every op of the step). Set on the thread that runs the forward (OpenMP's
thread count is that thread's own). Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CpuThreads:
    steps: int
    small_steps: int
    small_step_tokens: int
    _current: int = field(default=0, init=False)

    def apply(self, num_tokens: int) -> None:
        """Set the calling thread's torch threads for a step of ``num_tokens``."""
        threads = self.small_steps if num_tokens <= self.small_step_tokens else self.steps
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads
