"""The command line's shared flags: a flag per config option and the
configs back from parsed flags, and the output flags (``-v``,
``--log-json``, ``--json``).

The engine flags are derived from the config's fields
(:func:`asyncstep.config.engine_options`): one per option, its description
and default as help, ``none`` accepted where None is a value, bools as
``--x/--no-x``; ``serve``'s own flags likewise from
:class:`asyncstep.server.config.ServerConfig`. ``asyncstep bench`` builds its
engine flags with these functions too (:class:`asyncstep.bench.CliFlags`).

Imports nothing heavy: only ``asyncstep.config``, the front end's
``make_config`` and the server's config.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from typing import Any, get_args, get_origin

import msgspec

from asyncstep.config import EngineConfig, EngineOption, engine_options
from asyncstep.engine.front_end.api import make_config
from asyncstep.server.config import ServerConfig, server_options

#: The command's name, in its usage and in the lines it prints.
PROG = "asyncstep"

#: Flags kept from before the engine flags were derived from the config
#: (option -> more flags for it; a bool's alias gets its ``--no-`` form too).
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tp",),
    "pipeline_parallel_size": ("--pp",),
    "kv_cache_memory_gib": ("--kv-cache-memory",),
    "async_scheduling": ("--overlap",),
    "enable_ubatching": ("--ubatching",),
}
#: Options whose flag is not ``--`` + their name (``--seed`` is the sampling seed).
FLAG_NAMES: dict[str, str] = {"seed": "--engine-seed"}
#: Options the CLI sets from its other flags (``-v``, ``--log-json``).
DERIVED_OPTIONS = frozenset({"rank_log_level", "rank_log_json"})
#: Options whose values the config stores upper-case, whatever case is given.
UPPER_CASE_OPTIONS = frozenset({"cudagraph_mode"})
_METAVARS = {
    "model": "PATH",
    "kv_cache_memory_gib": "GIB",
    "listen": "HOST:PORT",
    "tensor_parallel_size": "N",
    "pipeline_parallel_size": "M",
    "cudagraph_mode": "MODE",
    "api_key": "KEY",
    "served_model_name": "NAME",
    "host": "HOST",
    "port": "PORT",
    "shutdown_timeout": "SECONDS",
    "keep_alive_timeout": "SECONDS",
    "body_read_timeout": "SECONDS",
    "speculative_config": "JSON",
}
#: The help group of each config section.
_GROUPS = {
    "model": "model",
    "cache": "KV cache",
    "scheduler": "scheduler",
    "parallel": "parallelism",
    "compilation": "device fast path",
    "structured_outputs": "structured outputs",
    "speculative": "speculative decoding",
}


def add_engine_flags(
    parser: argparse.ArgumentParser,
    before_sections: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """A flag per engine option, grouped by config section (``before_sections``
    adds its groups after the model's)."""
    groups = {"model": parser.add_argument_group(_GROUPS["model"])}
    if before_sections is not None:
        before_sections(parser)
    groups.update({s: parser.add_argument_group(t) for s, t in _GROUPS.items() if s != "model"})
    for option in engine_options().values():
        if option.name not in DERIVED_OPTIONS:
            add_engine_flag(groups[option.section], option)
    groups["parallel"].add_argument(
        "--external-ranks",
        dest=_dest("launch_ranks"),
        action="store_false",
        help="do not start the ranks: wait for them to connect (python -m asyncstep.rank); "
        "same as --no-launch-ranks",
    )


def add_output_flags(parser: argparse.ArgumentParser, *, json_flag: bool) -> None:
    """``--log-json`` and ``-v`` (and, with ``json_flag``, ``--json``)."""
    out = parser.add_argument_group("output")
    if json_flag:
        out.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    out.add_argument(
        "--log-json",
        metavar="FILE",
        help="write every log event (step-timeline spans too) as JSON lines; the engine-core "
        "process writes FILE.core, started ranks FILE.rank<N> (read them all with: "
        "asyncstep trace FILE FILE.* -o trace.json)",
    )
    out.add_argument(
        "-v", "--verbose", action="count", default=0, help="log to stderr: -v info, -vv every step"
    )


def engine_flag(name: str) -> str:
    """The flag of engine option ``name`` (aliases aside)."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def _dest(name: str) -> str:
    """Where the flag of option ``name`` is parsed to: the flag's name
    (``engine_seed``: ``seed`` is the sampling seed's)."""
    return engine_flag(name)[2:].replace("-", "_")


def add_engine_flag(group: argparse._ArgumentGroup, option: EngineOption) -> None:
    """The flag of one engine option: its description and default as help,
    ``none`` accepted where None is a value, bools as ``--x/--no-x``."""
    flags = [engine_flag(option.name), *FLAG_ALIASES.get(option.name, ())]
    kind = option.value_type
    common: dict[str, Any] = {"dest": _dest(option.name), "default": option.default}
    if kind is bool:
        action = group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
    elif get_origin(kind) is list:
        (item,) = get_args(kind)
        action = group.add_argument(
            *flags,
            nargs="+",
            type=value_parser(item, option.optional),
            action=_ListOrNone,
            metavar=_METAVARS.get(option.name, "N"),
            **common,
        )
    else:
        upper = option.name in UPPER_CASE_OPTIONS
        action = group.add_argument(
            *flags,
            type=str.upper if upper else value_parser(kind, option.optional),
            choices=option.choices,
            metavar=_METAVARS.get(option.name, _metavar(option)),
            **common,
        )
    # Set afterwards: BooleanOptionalAction would append its own default.
    action.help = f"{option.description} (default: {_shown(option.default)})".replace("%", "%%")


def value_parser(kind: type, optional: bool) -> Callable[[str], Any]:
    """argparse's ``type`` for ``kind``; with ``optional``, ``none`` is None."""

    struct = isinstance(kind, type) and issubclass(kind, msgspec.Struct)

    def parse(text: str) -> Any:
        if optional and text.lower() == "none":
            return None
        if struct:  # JSON of its fields; the config checks them (one-line ConfigError)
            return json.loads(text)
        return kind(text)

    parse.__name__ = "JSON" if struct else kind.__name__  # argparse's "invalid int value: 'x'"
    return parse


def _metavar(option: EngineOption) -> str | None:
    if option.choices is not None:
        return None  # argparse shows {a,b,c}
    return {int: "N", float: "X"}.get(option.value_type, option.name.upper())


def _shown(default: object) -> str:
    """A default as a user would type it."""
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, list):
        return " ".join(map(str, default))
    return str(default)


class _ListOrNone(argparse.Action):
    """``--sizes 1 2 4`` is a list; ``--sizes none`` is None."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = list(values or [])
        if None in items:
            if len(items) > 1:
                raise argparse.ArgumentError(self, "none cannot be mixed with values")
            setattr(namespace, self.dest, None)
        else:
            setattr(namespace, self.dest, items)


def log_level(args: argparse.Namespace) -> str:
    """The console log level of ``-v`` (this process's, and the ranks')."""
    return ("warning", "info", "debug")[min(args.verbose, 2)]


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine config of parsed ``generate`` arguments: every engine flag,
    the ranks' logging from ``-v`` and ``--log-json``. A bad value raises
    :class:`ConfigError` (one line), as :func:`make_config` does."""
    options = {
        name: getattr(args, _dest(name)) for name in engine_options() if name not in DERIVED_OPTIONS
    }
    return make_config(**options, rank_log_level=log_level(args), rank_log_json=args.log_json)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server config of parsed ``serve`` arguments (ConfigError if bad)."""
    return ServerConfig.from_options(**{name: getattr(args, name) for name in server_options()})
