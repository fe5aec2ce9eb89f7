"""The command line: ``asyncstep generate [PROMPT ...]``.

Prompts come from the arguments, or one per line from stdin when none are
given. Errors a user can cause print one line on stderr and exit 1, without
a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import msgspec
import trio

from asyncstep.config import ATTENTION_BACKENDS, CUDAGRAPH_MODES
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.api import make_config, open_engine
from asyncstep.engine.engine import Engine, Prompt
from asyncstep.engine.outputs import Completion
from asyncstep.errors import AsyncstepError, leaves
from asyncstep.logging import configure_logging
from asyncstep.logging.trace import add_trace_parser
from asyncstep.progress import ProgressBar

PROG = "asyncstep"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate text for prompts")
    add_trace_parser(commands)
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: stdin lines)")
    model = gen.add_argument_group("model")
    model.add_argument(
        "--model",
        help="GGUF file or HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    model.add_argument(
        "--load-format", default="auto", choices=["auto", "gguf", "safetensors", "dummy"]
    )
    model.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    model.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    model.add_argument("--max-model-len", type=int, help="longest prompt + output")
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=256)
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, help="per-request seed (same seed, same tokens)")
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the tokenizer has one)",
    )
    engine = gen.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="async scheduling: launch step N+1 while step N is sampled (--no-overlap: "
        "one step at a time, for ablation and debugging)",
    )
    engine.add_argument(
        "--max-concurrent-batches",
        type=int,
        default=0,
        metavar="N",
        help="steps in flight (0: 1 without overlap, 2 with it, the pipeline depth with --pp)",
    )
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument(
        "--kv-cache-memory",
        type=float,
        default=1.0,
        metavar="GIB",
        help="KV cache size on the CPU (GiB)",
    )
    device = gen.add_argument_group("device fast path")
    device.add_argument(
        "--cudagraph-mode",
        type=str.upper,
        default="FULL_AND_PIECEWISE",
        choices=CUDAGRAPH_MODES,
        help="CUDA graphs by batch shape (CUDA only; default FULL_AND_PIECEWISE)",
    )
    device.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: triton on CUDA, torch on the CPU",
    )
    device.add_argument(
        "--ubatching",
        action="store_true",
        help="split large steps into two micro-batches (TP communication overlaps compute)",
    )
    parallel = gen.add_argument_group("parallelism")
    parallel.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks")
    parallel.add_argument("--pp", type=int, default=1, metavar="M", help="pipeline stages")
    parallel.add_argument(
        "--sequence-parallel", action="store_true", help="keep activations split along tokens"
    )
    parallel.add_argument(
        "--pp-tensor-lanes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="between stages, each TP rank sends 1/TP of a tensor and the next stage "
        "all-gathers (--no-pp-tensor-lanes: whole tensors, faster on one NVLink host)",
    )
    parallel.add_argument(
        "--external-ranks",
        action="store_true",
        help="do not start the ranks: wait for them to connect (python -m asyncstep.rank)",
    )
    parallel.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="address the ranks connect to (default: loopback, any free port)",
    )
    out = gen.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    out.add_argument(
        "--log-json",
        metavar="FILE",
        help="write every log event (step-timeline spans too) as JSON lines; started ranks "
        "write FILE.rank<N> (read them with: asyncstep trace FILE FILE.rank* -o trace.json)",
    )
    out.add_argument(
        "-v", "--verbose", action="count", default=0, help="log to stderr: -v info, -vv every step"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (handler := getattr(args, "handler", None)) is not None:
        return int(handler(args))  # a subcommand with its own handler (trace)
    args.log_level = ("warning", "info", "debug")[min(args.verbose, 2)]
    try:
        configure_logging(args.log_level, args.log_json)
        params = sampling_params(args)
        prompts = list(args.prompts) or read_prompts(sys.stdin)
        if not prompts:
            raise AsyncstepError("no prompts: pass them as arguments or on stdin")
        return trio.run(generate_all, args, prompts, params)
    except BaseException as exc:
        return exit_status(exc)


def exit_status(error: BaseException) -> int:
    """The exit status (and one stderr line) for an error a user can cause;
    Ctrl-C may arrive inside any task, so it can come wrapped in a group."""
    found = leaves(error)
    if any(isinstance(e, KeyboardInterrupt) for e in found):
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    for leaf in found:
        # OSError: e.g. --log-json into a missing directory.
        if isinstance(leaf, AsyncstepError | OSError):
            print(f"{PROG}: error: {leaf}", file=sys.stderr)
            return 1
    raise error


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def read_prompts(stream: TextIO) -> list[str]:
    return [line.rstrip("\n") for line in stream if line.strip()]


async def generate_all(args: argparse.Namespace, prompts: list[str], params: SamplingParams) -> int:
    """Serve every prompt concurrently; returns the exit status."""
    config = make_config(
        args.model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_gib=args.kv_cache_memory,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        sequence_parallel=args.sequence_parallel,
        pp_tensor_lanes=args.pp_tensor_lanes,
        launch_ranks=not args.external_ranks,
        listen=args.listen,
        rank_log_level=args.log_level,
        rank_log_json=args.log_json,
        async_scheduling=args.overlap,
        max_concurrent_batches=args.max_concurrent_batches,
        cudagraph_mode=args.cudagraph_mode,
        attention_backend=args.attention_backend,
        enable_ubatching=args.ubatching,
    )
    with ProgressBar("loading weights") as progress:
        async with open_engine(config=config, progress=progress.update) as engine:
            progress.close()
            chat = args.chat
            if chat is None:
                chat = bool(getattr(engine.tokenizer, "chat_template", None))
            requests: list[Prompt] = [
                [{"role": "user", "content": p}] if chat else p for p in prompts
            ]
            if len(prompts) == 1 and not args.json:
                return await _stream_one(engine, requests[0], params, prompts[0])
            return await _generate_many(engine, requests, params, prompts, args.json)


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
) -> int:
    """Many prompts, batched by the engine; results print in prompt order.
    A bad prompt fails alone (its error on stderr), the others are served."""
    results: list[Completion | AsyncstepError | None] = [None] * len(prompts)
    printed = 0

    def print_ready() -> None:
        nonlocal printed
        while printed < len(results) and (result := results[printed]) is not None:
            _print_result(prompts[printed], result, as_json)
            printed += 1

    async def one(i: int) -> None:
        try:
            results[i] = await engine.generate(requests[i], params)
        except AsyncstepError as exc:
            results[i] = exc
        print_ready()

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return 1 if any(isinstance(r, AsyncstepError) for r in results) else 0


def _print_result(prompt: str, result: Completion | AsyncstepError, as_json: bool) -> None:
    if isinstance(result, AsyncstepError):
        _print_error(prompt, result)
        if as_json:
            _emit({"prompt": prompt, "error": str(result)})
    elif as_json:
        record = msgspec.to_builtins(result)
        record["prompt"] = prompt
        _emit(record)
    else:
        print(result.text, flush=True)


def _print_error(prompt: str, error: AsyncstepError) -> None:
    shown = prompt if len(prompt) <= 40 else prompt[:37] + "..."
    print(f"{PROG}: error: prompt {shown!r}: {error}", file=sys.stderr)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record, ensure_ascii=False), flush=True)


if __name__ == "__main__":
    sys.exit(main())
