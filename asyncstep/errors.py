"""The errors asyncstep raises on purpose.

Every error a user can cause (a bad request, a bad model file, a configuration
that cannot work) is an :class:`AsyncstepError` with a one-line message; the
CLI prints that line and exits non-zero, without a traceback; so does its
argument parser (:class:`OneLineParser`). Also how to find the error that
matters in a group of them. Imports only anyio and the standard library.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

import anyio


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


class RankError(EngineDeadError):
    """A rank failed, died, or broke the control protocol."""


class EngineLoopError(AsyncstepError, RuntimeError):
    """An engine called from an event loop or thread other than the one it
    serves on (it would hang or corrupt its state): call it there, through a
    portal, or use the blocking ``asyncstep.LLM``."""


#: Errors a task sees because another task died and closed a channel.
CONSEQUENCES = (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError)


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in leaves(e)]
    return [error]


def root_cause(error: BaseException) -> BaseException:
    """The first error of a group that is not a consequence of another."""
    found = leaves(error)
    return next((e for e in found if not isinstance(e, CONSEQUENCES)), found[0])


def describe(error: BaseException) -> str:
    """An error in one line, its type when it says nothing itself."""
    return str(error) or type(error).__name__


def error_kind(error: BaseException) -> str | None:
    """The name of ``error``'s class if it is one of this module's (so that
    it can cross a process boundary as a name and a message), else None."""
    name = type(error).__name__
    return name if _KINDS.get(name) is type(error) else None


def error_from_core(message: str, kind: str | None) -> AsyncstepError:
    """The error an engine-core process reported: of its own class when
    that is one of this module's, else an :class:`EngineDeadError`."""
    cls = _KINDS.get(kind or "", EngineDeadError)
    return cls(message)


_KINDS: dict[str, type[AsyncstepError]] = {
    cls.__name__: cls
    for cls in (
        AsyncstepError,
        InvalidRequestError,
        ConfigError,
        ModelLoadError,
        UnsupportedModelError,
        EngineDeadError,
        RankError,
        EngineLoopError,
    )
}


def exit_status(error: BaseException, prog: str = "asyncstep") -> int:
    """A command's exit status (and one stderr line, ``prog: ...``) for an
    error a user can cause; any other error is raised again. Ctrl-C may
    arrive inside any task, so it can come wrapped in a group."""
    found = leaves(error)
    if any(isinstance(e, KeyboardInterrupt) for e in found):
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    for leaf in found:
        # OSError: e.g. --log-json into a missing directory.
        if isinstance(leaf, AsyncstepError | OSError):
            print(f"{prog}: error: {leaf}", file=sys.stderr)
            return 1
    raise error


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr, ``PROG: error:
    MESSAGE (run 'PROG --help' for the options)``, and exit status 1, as every
    other error a user can cause (argparse's own: the whole usage, status 2);
    ``--help`` is argparse's. Its subcommands' parsers are of its class, and
    an argument no parser knows is reported by the subcommand it was given to."""

    def error(self, message: str) -> NoReturn:
        listed = "commands" if self._subparsers is not None else "options"
        line = " ".join(message.split())
        self.exit(1, f"{self.prog}: error: {line} (run '{self.prog} --help' for the {listed})\n")

    def parse_args(  # type: ignore[override]  # (a namespace is never passed in)
        self, args: Sequence[str] | None = None, namespace: None = None
    ) -> argparse.Namespace:
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self._command_parser(parsed).error(f"unrecognized arguments: {' '.join(unknown)}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> OneLineParser:
        """The parser of the (sub)command ``parsed`` chose, deepest first."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, OneLineParser):
                    return chosen._command_parser(parsed)
        return self
