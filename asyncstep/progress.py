"""A rich progress bar on stderr (on a terminal only; silent otherwise)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import Progress, TaskID

__all__ = ["ProgressBar"]


class ProgressBar:
    """``with ProgressBar("loading weights") as bar: ... bar.update(done, total)``."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> ProgressBar:
        if sys.stderr.isatty():
            self._progress = Progress(transient=True, console=Console(stderr=True))
            self._progress.start()
            self._task = self._progress.add_task(self.label, total=None)
        return self

    def update(self, done: int, total: int) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __exit__(self, *exc: object) -> None:
        self.close()
