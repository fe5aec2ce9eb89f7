"""Capturing a runner's CUDA graphs at start-up, with a progress bar."""

from __future__ import annotations

import time

from asyncstep.logging import get_logger
from asyncstep.progress import ProgressBar
from asyncstep.runner.cudagraph_dispatcher import CUDAGraphMode
from asyncstep.runner.model_runner import ModelRunner

__all__ = ["capture_cuda_graphs"]

log = get_logger(__name__)


def capture_cuda_graphs(runner: ModelRunner, show_progress: bool = True) -> None:
    """Capture the runner's CUDA graphs (if its mode has any), with a progress bar."""
    if not runner.dispatcher.capture_sizes or runner.dispatcher.mode is CUDAGraphMode.NONE:
        return
    t0 = time.perf_counter()
    with ProgressBar("capturing CUDA graphs") as bar:
        num_graphs = runner.capture_model(bar.update if show_progress else None)
    log.info(
        "cuda graphs captured",
        mode=runner.dispatcher.mode.name,
        sizes=len(runner.dispatcher.capture_sizes),
        graphs=num_graphs,
        seconds=round(time.perf_counter() - t0, 2),
    )
