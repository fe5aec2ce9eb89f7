"""The command line: ``asyncstep generate [PROMPT ...]`` and ``asyncstep serve``.

This package's root assembles the parser (``generate``, ``serve``, ``trace``,
``bench``) and runs the command: :func:`main` (``python -m asyncstep.cli``
too), :func:`run` (the ``asyncstep`` script). The flags every command shares,
derived from the config's fields, are in :mod:`asyncstep.cli.flags`;
``generate``'s own flags, its prompts and what it prints in
:mod:`asyncstep.cli.generate`. Errors a user can cause print one line on
stderr and exit 1, without a traceback (a bad flag too:
:class:`~asyncstep.errors.OneLineParser`).

May import the front end (the engine's API, the server's config and, at
``serve`` only, the server), the logging, and :mod:`asyncstep.bench` only
inside ``asyncstep bench``: nothing heavy at import.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from typing import NoReturn

import trio

from asyncstep.cli.flags import (
    DERIVED_OPTIONS,
    PROG,
    add_engine_flag,
    add_engine_flags,
    add_output_flags,
    config_from_args,
    engine_flag,
    log_level,
    server_config_from_args,
)
from asyncstep.cli.generate import add_sampling_flags, generate_all, read_prompts, sampling_params
from asyncstep.errors import AsyncstepError, OneLineParser, exit_status
from asyncstep.logging import configure_logging
from asyncstep.logging.spans import process_start_us, record_startup
from asyncstep.logging.trace import add_trace_parser
from asyncstep.procs import exit_now
from asyncstep.progress import ProgressBar
from asyncstep.server.config import server_options

__all__ = [
    "DERIVED_OPTIONS",
    "add_engine_flag",
    "add_engine_flags",
    "build_parser",
    "config_from_args",
    "engine_flag",
    "generate_all",
    "main",
    "run",
    "run_bench",
    "run_serve",
    "sampling_params",
    "server_config_from_args",
]


def build_parser() -> argparse.ArgumentParser:
    """``asyncstep generate`` (an engine flag per config option, and the
    sampling and output flags), ``asyncstep serve`` (the engine flags and
    the server's) and ``asyncstep trace``."""
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="generate text for prompts",
        description="Generate text for prompts. Every engine option (make_config's keywords) "
        "is a flag; options that may be unset take 'none'.",
    )
    add_trace_parser(commands)
    commands.add_parser(
        "bench",
        help="benchmarks: asyncstep bench latency|throughput|serve|startup (each with --help)",
        add_help=False,
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: stdin lines)")
    add_engine_flags(gen, before_sections=add_sampling_flags)
    add_output_flags(gen, json_flag=True)
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize) until SIGTERM or Ctrl-C. "
        "Every engine option is a flag, as for generate.",
    )
    server = serve.add_argument_group("server")
    for option in server_options().values():
        add_engine_flag(server, option)
    add_engine_flags(serve)
    add_output_flags(serve, json_flag=False)
    serve.set_defaults(handler=run_serve)
    return parser


def run() -> NoReturn:
    """The ``asyncstep`` command: :func:`main`, then a quick exit
    (:func:`~asyncstep.procs.exit_now`)."""
    exit_now(main())


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    if (handler := getattr(args, "handler", None)) is not None:
        return int(handler(args))  # a subcommand with its own handler (trace)
    try:
        configure_logging(log_level(args), args.log_json)
        record_startup("imports", process_start_us())
        params = sampling_params(args)
        if not args.prompts and sys.stdin.isatty():
            print(
                f"{PROG}: reading prompts, one a line; Ctrl-D ends",
                file=sys.stderr,
            )
        prompts = list(args.prompts) or read_prompts(sys.stdin)
        if not prompts:
            raise AsyncstepError("no prompts: pass them as arguments or on stdin")
        return trio.run(generate_all, args, prompts, params)
    except BaseException as exc:
        return exit_status(exc)


def run_serve(args: argparse.Namespace) -> int:
    """``asyncstep serve``: serve until SIGTERM or Ctrl-C (exit 0), printing
    ``asyncstep: serving MODEL on URL`` on stdout once it listens, and on
    stderr, at the first signal, what the stop waits for."""
    try:
        configure_logging(log_level(args), args.log_json)
        record_startup("imports", process_start_us())
        engine_config = config_from_args(args)
        server_config = server_config_from_args(args)
        from asyncstep.server.serve import serve

        with ProgressBar("loading weights") as progress:

            def ready(url: str, model: str) -> None:
                progress.close()
                print(f"{PROG}: serving {model} on {url}", flush=True)

            def notice(line: str) -> None:
                print(f"{PROG}: {line}", file=sys.stderr, flush=True)

            trio.run(
                functools.partial(
                    serve,
                    engine_config,
                    server_config,
                    ready=ready,
                    progress=progress.update,
                    log_level=log_level(args),
                    notice=notice,
                )
            )
        return 0
    except BaseException as exc:
        return exit_status(exc)


def run_bench(argv: Sequence[str]) -> int:
    """``asyncstep bench ARGV`` (:mod:`asyncstep.bench`, imported here only),
    with this command line's engine flags."""
    from asyncstep.bench import CliFlags
    from asyncstep.bench import main as bench_main

    flags = CliFlags(add_engine_flags, add_engine_flag, config_from_args, server_config_from_args)
    return bench_main(argv, flags)
