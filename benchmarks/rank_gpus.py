"""Moved to :mod:`asyncstep.bench.rank_gpus` (kept here for the scripts that import it)."""

from asyncstep.bench.rank_gpus import (
    open_config_on_gpus,
    open_engine_on_gpus,
    rank_gpus,
    start_ranks,
    stop_ranks,
)

__all__ = ["open_config_on_gpus", "open_engine_on_gpus", "rank_gpus", "start_ranks", "stop_ranks"]
