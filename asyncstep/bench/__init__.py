"""``asyncstep bench latency | throughput | serve | startup``: the benchmarks
as a subcommand, vLLM's names and figures, one results format.

Each mode takes every engine flag of ``asyncstep generate`` (the command
line lends its flag builder, :class:`~asyncstep.bench.args.CliFlags`, so
this package never imports it), writes one JSON record
(:class:`~asyncstep.bench.results.Result`) and prints a table. A mode's
module is imported only when it runs: nothing here imports torch.

The other maintained measurements are modules run as ``python3 -m
asyncstep.bench.NAME`` (:mod:`~asyncstep.bench.host_cpu`,
:mod:`~asyncstep.bench.pp_transfer`, :mod:`~asyncstep.bench.layout_tokens`,
:mod:`~asyncstep.bench.door` with its harness
:mod:`~asyncstep.bench.door_harness`, :mod:`~asyncstep.bench.tool_validity`),
writing the same format (:mod:`~asyncstep.bench.measurement`); the tests
import them. This package may import the engine and below, and the server
(``tool_validity``), never the command line.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from asyncstep.bench.args import MODES, CliFlags, parse_bench_args
from asyncstep.errors import exit_status

__all__ = ["MODES", "CliFlags", "main"]


def main(argv: Sequence[str], cli: CliFlags) -> int:
    """``asyncstep bench ARGV``: parse, run the mode; a bad flag or a
    user's error (a bad value, a missing file) is one line on stderr and
    exit status 1."""
    parsed = parse_bench_args(argv, cli)
    try:
        if parsed.mode == "latency":
            from asyncstep.bench.latency import run
        elif parsed.mode == "throughput":
            from asyncstep.bench.throughput import run
        elif parsed.mode == "serve":
            from asyncstep.bench.serve import run
        else:
            from asyncstep.bench.startup import run
        return run(parsed)
    except BaseException as exc:
        sys.stdout.flush()
        return exit_status(exc)
