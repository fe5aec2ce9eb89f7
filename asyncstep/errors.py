"""The errors asyncstep raises on purpose.

Every error a user can cause (a bad request, a bad model file, a configuration
that cannot work) is an :class:`AsyncstepError` with a one-line message; the
CLI prints that line and exits non-zero, without a traceback. Imports nothing.
"""

from __future__ import annotations


class AsyncstepError(Exception):
    """Base of every error asyncstep raises on purpose."""


class InvalidRequestError(AsyncstepError, ValueError):
    """A request (prompt or sampling parameters) that cannot be served.

    It fails that request alone; the engine keeps serving the others.
    """


class ConfigError(AsyncstepError, ValueError):
    """An engine, cache or parallel configuration that cannot work."""


class ModelLoadError(AsyncstepError):
    """A model path, file or checkpoint that cannot be loaded."""


class UnsupportedModelError(ModelLoadError):
    """A checkpoint of an architecture asyncstep does not implement."""


class EngineDeadError(AsyncstepError):
    """The engine stopped (a rank failed, or it was closed): the request cannot finish."""
