"""structlog configuration, the contextvars (rank, step) of every event,
and :func:`notice`: a line for the user, whatever the configuration."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from asyncstep.logging.spans import set_span_sink

LOGGER_NAME = "asyncstep"

_PROCESSORS: list[Any] = [
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
    structlog.processors.format_exc_info,
    structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
]

logging.getLogger(LOGGER_NAME).addHandler(logging.NullHandler())

#: The JSON-lines file of the current set-up (child processes log next to it).
_json_file: Path | None = None
#: The rank this process runs, once :func:`bind_rank` was called (None: none yet).
_process_rank: int | None = None


def configure_logging(
    level: str = "info",
    json_file: str | Path | None = None,
    *,
    console: bool = True,
    stream: Any = None,
) -> None:
    """Send asyncstep's events to the console (readable, at ``level``) and,
    when ``json_file`` is given, to that file as JSON lines (every level,
    step events included). Calling it again replaces the previous set-up.

    Until it is called asyncstep logs nothing of its own: its events go to
    the standard ``logging`` logger ``"asyncstep"``, for an application's own
    handlers. structlog's global configuration is left alone.
    """
    global _json_file
    set_span_sink(None)
    _json_file = Path(json_file) if json_file is not None else None
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.propagate = not (console or json_file)
    levels = []
    if console:
        out = stream if stream is not None else sys.stderr
        handler = logging.StreamHandler(out)
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(out))
        handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=renderer))
        handler.setLevel(level.upper())
        logger.addHandler(handler)
        levels.append(handler.level)
    file_handler = None
    if json_file is not None:
        file_handler = logging.FileHandler(json_file, mode="w", encoding="utf-8")
        file_handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(processor=structlog.processors.JSONRenderer())
        )
        file_handler.setLevel(logging.DEBUG)
        logger.addHandler(file_handler)
        levels.append(logging.DEBUG)
    logger.setLevel(min(levels) if levels else logging.CRITICAL + 1)
    set_span_sink(file_handler)  # spans go to the JSON file only


def json_log_file() -> Path | None:
    """The JSON-lines file :func:`configure_logging` writes to, if any."""
    return _json_file


def _isatty(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def get_logger(name: str = LOGGER_NAME) -> structlog.stdlib.BoundLogger:
    """A structlog logger over the standard logger ``asyncstep.<name>``."""
    if name != LOGGER_NAME and not name.startswith(LOGGER_NAME + "."):
        name = f"{LOGGER_NAME}.{name}"
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(name),
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return logger


def bind_rank(rank: int) -> None:
    """Tag every later event of this context (a rank's tasks) with its rank
    (and take it as this process's, for :func:`notice`)."""
    global _process_rank
    _process_rank = rank
    structlog.contextvars.bind_contextvars(rank=rank)


def notice(message: str) -> None:
    """Tell the user, on stderr, of something that takes a while and is not
    an error (``asyncstep: MESSAGE``), whether logging is configured or not:
    once per engine, so a rank process other than the first keeps quiet.
    The engine-core and rank processes share the user's stderr; on a
    terminal the line first clears the one the cursor is on (the caller's
    progress bar, which redraws itself below it)."""
    if _process_rank not in (None, 0):
        return
    clear = "\r\x1b[2K" if _isatty(sys.stderr) else ""
    print(f"{clear}asyncstep: {message}", file=sys.stderr, flush=True)


def shown_path(path: Path) -> str:
    """``path`` as a user would write it in a message: ``~/...`` under the
    home directory."""
    try:
        return str(Path("~") / path.relative_to(Path.home()))
    except ValueError:
        return str(path)


@contextmanager
def bound_step(step: int) -> Iterator[None]:
    """Tag the events inside with the step id."""
    with structlog.contextvars.bound_contextvars(step=step):
        yield
