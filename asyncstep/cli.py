"""The command line: ``asyncstep generate [PROMPT ...]`` and ``asyncstep serve``.

Prompts come from the arguments, or one per line from stdin when none are
given. The engine flags are derived from the config's fields
(:func:`asyncstep.config.engine_options`): one per option, its description
and default as help; ``serve``'s own flags likewise from
:class:`asyncstep.server.config.ServerConfig`. Errors a user can cause print
one line on stderr and exit 1, without a traceback (a bad flag too:
:class:`~asyncstep.errors.OneLineParser`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO, get_args, get_origin

import msgspec
import trio

from asyncstep.checks import is_utf8
from asyncstep.config import EngineConfig, EngineOption, engine_options
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.front_end.api import make_config, open_engine
from asyncstep.engine.front_end.engine import Engine
from asyncstep.engine.front_end.input_processor import Prompt
from asyncstep.engine.messages.outputs import Completion
from asyncstep.engine.structured_output.grammar import check_grammar
from asyncstep.errors import AsyncstepError, OneLineParser, exit_status
from asyncstep.logging import configure_logging
from asyncstep.logging.spans import process_start_us, record_startup
from asyncstep.logging.trace import add_trace_parser
from asyncstep.procs import exit_now
from asyncstep.progress import ProgressBar
from asyncstep.server.config import ServerConfig, server_options
from asyncstep.structured_params import StructuredOutputsParams

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
    _add_engine_flags(gen, before_sections=_add_sampling_flags)
    _add_output_flags(gen, json_flag=True)
    serve = commands.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        description="Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize) until SIGTERM or Ctrl-C. "
        "Every engine option is a flag, as for generate.",
    )
    server = serve.add_argument_group("server")
    for option in server_options().values():
        _add_engine_flag(server, option)
    _add_engine_flags(serve)
    _add_output_flags(serve, json_flag=False)
    serve.set_defaults(handler=run_serve)
    return parser


def _add_engine_flags(
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
            _add_engine_flag(groups[option.section], option)
    groups["parallel"].add_argument(
        "--external-ranks",
        dest=_dest("launch_ranks"),
        action="store_false",
        help="do not start the ranks: wait for them to connect (python -m asyncstep.rank); "
        "same as --no-launch-ranks",
    )


def _add_output_flags(parser: argparse.ArgumentParser, *, json_flag: bool) -> None:
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


def _add_sampling_flags(gen: argparse.ArgumentParser) -> None:
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--n", type=int, default=1, help="choices per prompt (default: 1)")
    sampling.add_argument(
        "--max-tokens",
        type=_value_parser(int, optional=True),
        default=256,
        metavar="N",
        help="most tokens generated; the prompt and they must fit the context (--max-model-len), "
        "else the prompt is refused; none: what the context leaves (default: 256)",
    )
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="(default: 1: off)")
    sampling.add_argument("--top-k", type=int, default=0, help="0 or -1: off (default: 0)")
    sampling.add_argument("--min-p", type=float, default=0.0, help="(default: 0: off)")
    sampling.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: minus this for tokens in the output (default: 0)",
    )
    sampling.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="in [-2, 2]: minus this times the count in the output (default: 0)",
    )
    sampling.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 0, 1 is off: penalizes the tokens of the prompt and the output (default: 1)",
    )
    sampling.add_argument("--seed", type=int, help="per-request seed (same seed, same tokens)")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument(
        "--ignore-eos", action="store_true", help="generate past the end-of-sequence token"
    )
    sampling.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="K",
        help="log-probs of each prompt token and the top K of its position (with --json)",
    )
    sampling.add_argument(
        "--token-ids",
        action="store_true",
        help="each prompt is token ids separated by spaces or commas (a model without a "
        "tokenizer, e.g. --load-format dummy --model tiny-llama)",
    )
    sampling.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the tokenizer has one)",
    )
    structured = gen.add_argument_group("structured outputs (at most one)")
    structured.add_argument(
        "--json-schema", metavar="FILE", help="the output follows this JSON schema file"
    )
    structured.add_argument("--json-object", action="store_true", help="the output is JSON")
    structured.add_argument("--regex", help="the output matches this regular expression")
    structured.add_argument(
        "--choice", action="append", help="the output is one of these (repeatable)"
    )
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this EBNF file")


def engine_flag(name: str) -> str:
    """The flag of engine option ``name`` (aliases aside)."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def _dest(name: str) -> str:
    """Where the flag of option ``name`` is parsed to: the flag's name
    (``engine_seed``: ``seed`` is the sampling seed's)."""
    return engine_flag(name)[2:].replace("-", "_")


def _add_engine_flag(group: argparse._ArgumentGroup, option: EngineOption) -> None:
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
            type=_value_parser(item, option.optional),
            action=_ListOrNone,
            metavar=_METAVARS.get(option.name, "N"),
            **common,
        )
    else:
        upper = option.name in UPPER_CASE_OPTIONS
        action = group.add_argument(
            *flags,
            type=str.upper if upper else _value_parser(kind, option.optional),
            choices=option.choices,
            metavar=_METAVARS.get(option.name, _metavar(option)),
            **common,
        )
    # Set afterwards: BooleanOptionalAction would append its own default.
    action.help = f"{option.description} (default: {_shown(option.default)})".replace("%", "%%")


def _value_parser(kind: type, optional: bool) -> Callable[[str], Any]:
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

    flags = CliFlags(_add_engine_flags, _add_engine_flag, config_from_args, server_config_from_args)
    return bench_main(argv, flags)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The server config of parsed ``serve`` arguments (ConfigError if bad)."""
    return ServerConfig.from_options(**{name: getattr(args, name) for name in server_options()})


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as SamplingParams: built before the model loads, so
    that a bad flag is refused at once (InvalidRequestError, one line)."""
    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        prompt_logprobs=args.prompt_logprobs,
        structured_outputs=structured_outputs(args),
    )


def structured_outputs(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The structured-output flags (files read here: a missing one is a one-line error)."""
    given = {
        "json": _read_flag_file("--json-schema", args.json_schema),
        "json_object": args.json_object or None,
        "regex": args.regex,
        "choice": args.choice,
        "grammar": _read_flag_file("--grammar", args.grammar),
    }
    given = {kind: value for kind, value in given.items() if value is not None}
    if not given:
        return None
    params = StructuredOutputsParams(**given)
    check_grammar(params)  # before the model loads: a bad one fails at once
    return params


def _read_flag_file(flag: str, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise AsyncstepError(f"{flag} {path}: cannot read it: {exc}") from None


def read_prompts(stream: TextIO) -> list[str]:
    return [line.rstrip("\n") for line in stream if line.strip()]


async def generate_all(args: argparse.Namespace, prompts: list[str], params: SamplingParams) -> int:
    """Serve every prompt concurrently; returns the exit status."""
    config = config_from_args(args)
    with ProgressBar("loading weights") as progress:
        async with open_engine(config=config, progress=progress.update) as engine:
            progress.close()
            chat = args.chat
            if chat is None:
                chat = bool(getattr(engine.tokenizer, "chat_template", None))
            requests = [token_ids(p) if args.token_ids else to_request(p, chat) for p in prompts]
            ids = engine.tokenizer is None  # no text: the output's token ids are shown
            if len(prompts) == 1 and not args.json and params.n == 1 and not ids:
                return await _stream_one(engine, requests[0], params, prompts[0])
            return await _generate_many(engine, requests, params, prompts, args.json, ids)


def token_ids(prompt: str) -> list[int]:
    """``--token-ids``: a prompt of token ids, separated by spaces or commas."""
    try:
        return [int(part) for part in prompt.replace(",", " ").split()]
    except ValueError:
        raise AsyncstepError(
            f"--token-ids: prompt {prompt[:40]!r} is not token ids separated by spaces or commas"
        ) from None


def to_request(prompt: str, chat: bool) -> Prompt:
    """The engine's prompt for a command-line prompt: one user turn with
    ``chat``, else the text. An empty prompt stays empty text in both modes,
    so that the engine refuses it (a chat turn of no content would be served)."""
    return [{"role": "user", "content": prompt}] if chat and prompt else prompt


async def _stream_one(engine: Engine, request: Prompt, params: SamplingParams, prompt: str) -> int:
    """One prompt: print its text as it is generated."""
    try:
        async for chunk in engine.stream(request, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except AsyncstepError as exc:
        _print_error(prompt, exc)
        return 1
    sys.stdout.write("\n")
    return 0


async def _generate_many(
    engine: Engine,
    requests: list[Prompt],
    params: SamplingParams,
    prompts: list[str],
    as_json: bool,
    show_ids: bool = False,
) -> int:
    """Many prompts, batched by the engine; sent to it in prompt order (the
    scheduler serves them first come, first served) and printed in that
    order. A bad prompt fails alone (its error on stderr), the others are served."""
    results: list[Completion | AsyncstepError | None] = [None] * len(prompts)
    printed = 0

    def print_ready() -> None:
        nonlocal printed
        while printed < len(results) and (result := results[printed]) is not None:
            _print_result(prompts[printed], result, as_json, show_ids)
            printed += 1

    async def one(i: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()  # (generate() sends the request before its first wait)
        try:
            results[i] = await engine.generate(requests[i], params)
        except AsyncstepError as exc:
            results[i] = exc
        print_ready()

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            await nursery.start(one, i)
    return 1 if any(isinstance(r, AsyncstepError) for r in results) else 0


def _print_result(
    prompt: str, result: Completion | AsyncstepError, as_json: bool, show_ids: bool = False
) -> None:
    """One prompt's choices (``show_ids``: their token ids, for a model
    without a tokenizer), or its error."""
    if isinstance(result, AsyncstepError):
        _print_error(prompt, result)
        if as_json:
            _emit({"prompt": prompt, "error": str(result)})
    elif as_json:
        record = msgspec.to_builtins(result)
        record["prompt"] = prompt
        _emit(record)
    else:
        for output in result.outputs:  # the n choices, in order
            if len(result.outputs) > 1:
                print(f"--- choice {output.index} ---", flush=True)
            shown = " ".join(map(str, output.token_ids)) if show_ids else output.text
            print(shown, flush=True)


def _print_error(prompt: str, error: AsyncstepError) -> None:
    shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
    print(f"{PROG}: error: prompt {shown!r}: {error}", file=sys.stderr)


def _emit(record: dict[str, Any]) -> None:
    line = json.dumps(record, ensure_ascii=False)
    if not is_utf8(line):  # a prompt with a lone surrogate (undecodable argv bytes)
        line = json.dumps(record)
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
