"""Structured logs (structlog): configured once per process; ``rank`` and
``step`` ride in contextvars so every event of a rank's tasks carries them.
The console gets readable lines, ``json_file`` one JSON object per line.

May import structlog and the standard library only.
"""

from asyncstep.logging.setup import (
    bind_rank,
    bound_step,
    configure_logging,
    get_logger,
    json_log_file,
    notice,
    shown_path,
)

__all__ = [
    "bind_rank",
    "bound_step",
    "configure_logging",
    "get_logger",
    "json_log_file",
    "notice",
    "shown_path",
]
