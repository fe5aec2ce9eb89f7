"""``asyncstep generate``: its sampling and structured-output flags, the
prompts (arguments, or stdin lines), the engine that serves them all at once,
and what it prints: one prompt's text as it streams, else every prompt's
result in prompt order (``--json``: one JSON object each), a bad prompt's
error alone on stderr.

Imports the front end (the engine's API, its inputs and outputs) and
:mod:`asyncstep.cli.flags`; nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

import msgspec
import trio

from asyncstep.checks import is_utf8
from asyncstep.cli.flags import PROG, config_from_args, value_parser
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.front_end.api import open_engine
from asyncstep.engine.front_end.engine import Engine
from asyncstep.engine.front_end.input_processor import Prompt
from asyncstep.engine.messages.outputs import Completion
from asyncstep.engine.structured_output.grammar import check_grammar
from asyncstep.errors import AsyncstepError
from asyncstep.progress import ProgressBar
from asyncstep.structured_params import StructuredOutputsParams


def add_sampling_flags(gen: argparse.ArgumentParser) -> None:
    """``generate``'s sampling flags and structured-output flags (at most one)."""
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--n", type=int, default=1, help="choices per prompt (default: 1)")
    sampling.add_argument(
        "--max-tokens",
        type=value_parser(int, optional=True),
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
