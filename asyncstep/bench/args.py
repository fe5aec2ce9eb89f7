"""The flags of ``asyncstep bench MODE``: the mode's own, the common ones
(``--output-json``, ``-v``, ``--log-json``) and every engine flag of
``asyncstep generate``, built by the command line's own flag builder
(:class:`CliFlags`, lent by :mod:`asyncstep.cli`); ``serve`` also takes
``asyncstep serve``'s server flags.

A bad flag is one line on stderr (``asyncstep bench MODE: error: ...``,
with where the flags are listed) and exit status 1. Imports nothing heavy.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncstep.bench.results import Case, Column, Result, make_result, print_table, write
from asyncstep.config import EngineConfig, EngineOption
from asyncstep.errors import OneLineParser
from asyncstep.server.config import ServerConfig, server_options

MODES = ("latency", "throughput", "serve", "startup")
_DESCRIPTIONS = {
    "latency": "Latency of one batch, as vllm bench latency: per batch size and input length, "
    "the batch's end-to-end latency (mean and percentiles over iterations), TTFT and ITL "
    "from stream timestamps; optionally HF transformers' generate on the same shape, and "
    "the HBM floor of a decode step from the measured copy bandwidth.",
    "throughput": "Offline throughput, as vllm bench throughput: every request submitted at "
    "once; requests/s, output and total tokens/s (and the GPU busy fraction from the "
    "step-timeline spans); optionally HF's static batches and the HBM floor.",
    "serve": "Online serving, as vllm bench serve: a client load of random token-id prompts "
    "(Poisson arrivals, a concurrency cap) against asyncstep serve (started here with the "
    "engine and server flags, or --base-url); TTFT, TPOT, ITL and E2E percentiles, "
    "goodput; optionally the same load through the Python API in the same run.",
    "startup": "Cold start, each case a fresh process: import asyncstep, asyncstep --help, "
    "asyncstep generate, asyncstep serve to its ready line (per API server count), "
    "open_engine() to the first token; then one generate's start-up timeline. The engine "
    "flags go to generate, serve and open_engine.",
}
#: Engine options a mode sizes for its workload unless the command line gives them.
SIZED_OPTIONS = ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "num_blocks")


@dataclass(frozen=True)
class CliFlags:
    """What the command line lends the benchmarks (its functions, so that
    the engine flags are the same flags, built once, and this package does
    not import the command line)."""

    #: Adds a flag per engine option to a parser, grouped by config section.
    add_engine_flags: Callable[[argparse.ArgumentParser], None]
    #: Adds the flag of one option (a server option here) to a group.
    add_flag: Callable[[argparse._ArgumentGroup, EngineOption], None]
    #: The engine config of parsed engine flags (ConfigError if bad).
    engine_config: Callable[[argparse.Namespace], EngineConfig]
    #: The server config of parsed server flags (ConfigError if bad).
    server_config: Callable[[argparse.Namespace], ServerConfig]


@dataclass(frozen=True)
class BenchArgs:
    """A parsed ``asyncstep bench`` command line."""

    mode: str
    #: Every flag, parsed (engine options not given hold their defaults).
    args: argparse.Namespace
    #: The arguments after ``bench``, as given.
    argv: list[str]
    #: The engine (and, for serve, server) flags as given, for child processes.
    engine_argv: list[str]
    #: The parsed names (dests) of the engine flags the command line gave.
    given: frozenset[str]
    cli: CliFlags

    def engine_config(self, **sizing: Any) -> EngineConfig:
        """The engine config of the flags; ``sizing`` (option name -> value)
        applies to the options the command line did not give."""
        args = argparse.Namespace(**vars(self.args))
        for name, value in sizing.items():
            if name not in self.given:
                setattr(args, name, value)
        return self.cli.engine_config(args)

    def server_config(self) -> ServerConfig:
        return self.cli.server_config(self.args)

    def options(self) -> dict[str, Any]:
        """The mode's own flags (not the engine's), as JSON takes them."""
        skip = _engine_dests(self.cli, self.mode) | {"mode"}
        return {k: _plain(v) for k, v in sorted(vars(self.args).items()) if k not in skip}

    def publish(
        self,
        started: str,
        *,
        engine: EngineConfig | None,
        cases: list[Case],
        extra: dict[str, Any],
        columns: Sequence[Column],
        title: str,
    ) -> Result:
        """The run's record (:func:`~asyncstep.bench.results.make_result`:
        this mode, its arguments and :meth:`options`), written to
        ``--output-json`` where one is given, then printed as a table of
        ``columns`` under ``title``."""
        result = make_result(
            self.mode,
            self.argv,
            started,
            engine=engine,
            options=self.options(),
            cases=cases,
            extra=extra,
        )
        write(result, self.args.output_json)
        print_table(result, columns, title)
        return result


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return msgspec.to_builtins(value, str_keys=True, enc_hook=str)


def parse_bench_args(argv: Sequence[str], cli: CliFlags) -> BenchArgs:
    """Parse ``asyncstep bench ARGV`` (exits with status 1 and one line on
    a bad flag, 0 after ``--help``)."""
    argv = list(argv)
    args = build_parser(cli).parse_args(argv)
    engine = _engine_dests(cli, args.mode)
    # Parsed again with no defaults for the engine flags: what is left was given.
    probe = build_parser(cli)
    for action in _subparser(probe, args.mode)._actions:
        if action.dest in engine:
            action.default = argparse.SUPPRESS
    given = engine & vars(probe.parse_args(argv)).keys()
    _, engine_argv = build_parser(cli, engine_flags=False).parse_known_args(argv)
    _check(args, _subparser(build_parser(cli, engine_flags=False), args.mode))
    return BenchArgs(args.mode, args, argv, engine_argv, frozenset(given), cli)


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Values argparse's types cannot refuse alone."""
    positive = ["num_iters", "num_prompts", "output_len", "repeats", "client_processes"]
    positive += ["copy_repeats", "hf_repeats", "hf_batch", "max_concurrency", "min_len"]
    positive += ["num_prefixes"]
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("batch_size", "input_len", "api_server_counts"):
        values = getattr(args, name, None)
        if isinstance(values, list) and any(v < 1 for v in values):
            parser.error(f"--{name.replace('_', '-')} values must be >= 1, got {values}")
    if getattr(args, "min_len", 1) > getattr(args, "max_len", 1):
        parser.error(f"--min-len {args.min_len} is above --max-len {args.max_len}")
    if getattr(args, "request_rate", 1.0) <= 0:
        parser.error(f"--request-rate must be > 0, got {args.request_rate}")
    if isinstance(getattr(args, "input_len", None), int) and args.input_len < 1:
        parser.error(f"--input-len must be >= 1, got {args.input_len}")
    if getattr(args, "prefix_len", 0) < 0:
        parser.error(f"--prefix-len must be >= 0, got {args.prefix_len}")
    ratio = getattr(args, "range_ratio", 0.0)
    if not 0 <= ratio < 1:
        parser.error(f"--range-ratio must be in [0, 1), got {ratio}")


def _subparser(parser: argparse.ArgumentParser, mode: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = action.choices[mode]
    return found


def _engine_dests(cli: CliFlags, mode: str) -> set[str]:
    """The parsed names of the engine (for serve, and server) flags of ``mode``."""
    parser = OneLineParser(add_help=False)
    cli.add_engine_flags(parser)
    if mode == "serve":
        _add_server_flags(parser, cli)
    return {action.dest for action in parser._actions}


def _add_server_flags(parser: argparse.ArgumentParser, cli: CliFlags) -> None:
    group = parser.add_argument_group("server (of the server started here)")
    for option in server_options().values():
        cli.add_flag(group, option)


def build_parser(cli: CliFlags, *, engine_flags: bool = True) -> argparse.ArgumentParser:
    """``asyncstep bench`` with a subparser per mode (``engine_flags``
    False: the modes' own flags alone)."""
    parser = OneLineParser(
        prog="asyncstep bench",
        description="Benchmarks, as vllm bench: latency, throughput, serve, startup.",
        allow_abbrev=False,
    )
    modes = parser.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode in MODES:
        sub = modes.add_parser(
            mode,
            help=_DESCRIPTIONS[mode].split(":")[0],
            description=_DESCRIPTIONS[mode]
            + " Every engine option is a flag, as for asyncstep generate.",
            usage=f"asyncstep bench {mode} [options]",
            allow_abbrev=False,
        )
        _ADD[mode](sub)
        _add_common(sub)
        if engine_flags:
            if mode == "serve":
                _add_server_flags(sub, cli)
            cli.add_engine_flags(sub)
    return parser


def _add_common(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("output")
    out.add_argument(
        "--output-json",
        "--out",
        metavar="FILE",
        help="write the results here as JSON (the command, git revision, machine, config, figures)",
    )
    out.add_argument(
        "--log-json",
        metavar="FILE",
        help="write every log event as JSON lines (the engine core writes FILE.core)",
    )
    out.add_argument(
        "-v", "--verbose", action="count", default=0, help="log to stderr: -v info, -vv debug"
    )


def _add_hf_and_floor(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run HF transformers' generate (static KV cache; random weights of the "
        "model's shape), first, in this process (default: off)",
    )
    group.add_argument("--hf-from", metavar="FILE", help="quote HF's figures from an earlier JSON")
    group.add_argument(
        "--hf-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let generate compile its decode step (default: on CUDA)",
    )
    group.add_argument(
        "--hf-warmups", type=int, metavar="N", default=2, help="HF warm-ups per shape"
    )
    group.add_argument(
        "--hf-repeats", type=int, metavar="N", default=3, help="HF timed runs (median)"
    )
    group.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the device's copy bandwidth and compute the HBM floor (default: on)",
    )
    group.add_argument(
        "--copy-gib",
        type=float,
        metavar="X",
        help="bandwidth copy size in GiB (default: 1; CPU: 1/16)",
    )
    group.add_argument(
        "--copy-repeats", type=int, metavar="N", default=20, help="bandwidth copies (median)"
    )
    group.add_argument(
        "--rank-gpus",
        type=int,
        metavar="N",
        help="start the ranks here on N GPUs (fewer than tp x pp: stages share GPUs)",
    )


def _add_lengths(
    group: argparse._ArgumentGroup, input_len: int | None, output_len: int | None
) -> None:
    uniform = "uniform in [--min-len, --max-len]"
    group.add_argument(
        "--input-len",
        type=int,
        metavar="N",
        default=input_len,
        help=f"prompt tokens (default: {input_len or uniform})",
    )
    group.add_argument(
        "--output-len",
        type=int,
        metavar="N",
        default=output_len,
        help=f"output tokens (default: {output_len or uniform})",
    )
    group.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        metavar="X",
        default=0.0,
        help="lengths uniform within this ratio of --input-len / --output-len (default: 0)",
    )
    group.add_argument(
        "--seed", type=int, metavar="N", default=0, help="of the prompts (default: 0)"
    )


def _add_latency(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("latency")
    group.add_argument(
        "--batch-size",
        "--batch",
        type=int,
        metavar="N",
        nargs="+",
        default=[8],
        help="(default: 8)",
    )
    group.add_argument(
        "--input-len",
        "--prompt-len",
        type=int,
        metavar="N",
        nargs="+",
        default=[32],
        help="(default: 32)",
    )
    group.add_argument("--output-len", type=int, metavar="N", default=128, help="(default: 128)")
    group.add_argument(
        "--num-iters-warmup",
        type=int,
        metavar="N",
        default=1,
        help="warm-up runs of each batch, 4 tokens each (default: 1)",
    )
    group.add_argument(
        "--num-iters",
        type=int,
        metavar="N",
        default=5,
        help="timed runs of each batch (default: 5)",
    )
    group.add_argument(
        "--seed", type=int, metavar="N", default=0, help="of the prompts (default: 0)"
    )
    group.add_argument("--floor-only", action="store_true", help="only the floor: no engine, no HF")
    _add_hf_and_floor(group)


def _add_throughput(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("throughput")
    group.add_argument(
        "--num-prompts", "--num-requests", type=int, metavar="N", default=256, help="(default: 256)"
    )
    _add_lengths(group, None, None)
    group.add_argument("--min-len", type=int, metavar="N", default=100, help="(default: 100)")
    group.add_argument("--max-len", type=int, metavar="N", default=1024, help="(default: 1024)")
    group.add_argument(
        "--gpu-busy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trace the run for the GPU busy fraction (default: on)",
    )
    group.add_argument("--trace-dir", metavar="DIR", help="keep the span logs here")
    group.add_argument(
        "--hf-batch", type=int, metavar="N", default=64, help="HF's static batch (default: 64)"
    )
    _add_hf_and_floor(group)


def _add_serve(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("serve")
    group.add_argument("--num-prompts", type=int, metavar="N", default=200, help="(default: 200)")
    _add_lengths(group, 256, 128)
    group.add_argument(
        "--request-rate",
        type=float,
        metavar="X",
        default=math.inf,
        help="requests/s, Poisson arrivals; inf: all at once (default: inf)",
    )
    group.add_argument("--max-concurrency", type=int, metavar="N", help="most requests in flight")
    group.add_argument(
        "--prefix-len",
        type=int,
        metavar="N",
        default=0,
        help="tokens of a shared prefix before each prompt's own --input-len (default: 0)",
    )
    group.add_argument(
        "--num-prefixes",
        type=int,
        metavar="N",
        default=1,
        help="distinct shared prefixes (system prompts), one drawn per request (default: 1)",
    )
    group.add_argument(
        "--num-warmups",
        type=int,
        metavar="N",
        default=2,
        help="requests sent first, not counted (default: 2)",
    )
    group.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs in ms, KEY one of ttft, tpot, e2el (e.g. ttft:500 tpot:50)",
    )
    group.add_argument(
        "--base-url",
        metavar="URL",
        help="a server already running, e.g. http://127.0.0.1:8000 (give its engine flags too: "
        "the prompts are drawn from its model's vocabulary)",
    )
    group.add_argument("--served-model", help="the model name to send (default: the server's)")
    group.add_argument(
        "--client-processes",
        type=int,
        metavar="N",
        default=1,
        help="client processes sharing the load (one Python client saturates a core first)",
    )
    group.add_argument(
        "--in-process",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run the load through the Python API (Engine.stream), after the server "
        "stopped, for the HTTP layer's cost as a ratio (default: off)",
    )
    group.add_argument(
        "--cpu-usage",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="CPU seconds of the server, its engine core and the client over the HTTP run "
        "(a server started here; Linux)",
    )


def _add_startup(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("startup")
    group.add_argument(
        "--repeats", type=int, metavar="N", default=5, help="timed runs per case (median)"
    )
    group.add_argument(
        "--cases",
        nargs="+",
        metavar="CASE",
        help="a subset: import, help, generate, first-token, serve-N (default: all)",
    )
    group.add_argument(
        "--api-server-counts",
        type=int,
        metavar="N",
        nargs="+",
        default=[1, 2],
        help="(default: 1 2)",
    )
    group.add_argument(
        "--timeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one more generate, with its start-up timeline (default: on)",
    )


_ADD: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "latency": _add_latency,
    "throughput": _add_throughput,
    "serve": _add_serve,
    "startup": _add_startup,
}
