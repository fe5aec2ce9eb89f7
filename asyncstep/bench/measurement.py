"""What the maintained measurements run as ``python3 -m asyncstep.bench.NAME``
share (:mod:`~asyncstep.bench.host_cpu`, :mod:`~asyncstep.bench.pp_transfer`,
:mod:`~asyncstep.bench.layout_tokens`, :mod:`~asyncstep.bench.tool_validity`,
:mod:`~asyncstep.bench.door`): ``--engine-opt KEY=VALUE`` for the engine
options they pass on, and their record in ``asyncstep bench``'s one results
format (:class:`~asyncstep.bench.results.Result`: its ``mode`` the module's
name, its ``command`` the ``python3 -m`` line, a table's rows as its cases).

Imports :mod:`asyncstep.bench.results` only.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncstep.bench.results import Case, Result, make_result

__all__ = ["add_engine_opt", "engine_opt", "record", "row_case"]


def engine_opt(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``; the value parsed as JSON or Python's True/False/None,
    else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    python_words = {"True": True, "False": False, "None": None}
    if value in python_words:
        return key, python_words[value]
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_engine_opt(
    parser: argparse.ArgumentParser,
    help: str = "extra open_engine keyword (repeatable), e.g. engine_process=False",
) -> None:
    """``--engine-opt KEY=VALUE`` (repeatable): ``args.engine_opt`` is the
    list of (key, value) pairs from :func:`engine_opt`."""
    parser.add_argument(
        "--engine-opt", type=engine_opt, action="append", default=[], metavar="KEY=VALUE", help=help
    )


def _is_figure(value: Any) -> bool:
    """A number, or None (not measured)."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def row_case(row: Mapping[str, Any], params: Sequence[str], name: str | None = None) -> Case:
    """A table's row as a case: ``params`` the configuration it measured,
    its other numbers (and Nones: not measured) the figures, the rest (flags,
    lists, text) its detail; named ``name`` or its params joined."""
    given = {key: row[key] for key in params if key in row}
    rest = {key: value for key, value in row.items() if key not in given}
    return Case(
        name=name if name is not None else " ".join(str(v) for v in given.values()),
        params=given,
        figures={key: None if v is None else float(v) for key, v in rest.items() if _is_figure(v)},
        detail={key: v for key, v in rest.items() if not _is_figure(v)},
    )


def record(
    module: str,
    argv: Sequence[str],
    started: str,
    *,
    options: dict[str, Any],
    cases: list[Case],
    extra: dict[str, Any] | None = None,
) -> Result:
    """The record of one run of ``asyncstep.bench.<module>`` (``started``:
    :func:`~asyncstep.bench.results.now` when it began)."""
    return make_result(
        module,
        argv,
        started,
        engine=None,
        options={key: _plain(value) for key, value in options.items()},
        cases=cases,
        extra=extra,
        command=["python3", "-m", f"asyncstep.bench.{module}"],
    )


def _plain(value: Any) -> Any:
    """An option as JSON takes it (a path as its text)."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
