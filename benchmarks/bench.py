"""Moved: ``python3 -m asyncstep bench latency|throughput`` (asyncstep/bench/).

This shim keeps the old command lines working: it translates them to
``asyncstep bench`` and runs that (the results are the new JSON format;
RESULTS.md is no longer appended, ``--no-record`` is accepted and ignored)::

    python3 benchmarks/bench.py latency --no-record --no-hf --shape llama-8b --batch 1 \\
        --prompt-len 128 --output-len 64 --engine-opt fused_decode=true --out F
    # is
    python3 -m asyncstep bench latency --load-format dummy --model llama-8b \\
        --batch-size 1 --input-len 128 --output-len 64 --num-iters 1 --fused-decode --out F

``floor`` is ``asyncstep bench latency --floor-only``. The old defaults
stay (llama-1b; latency: batches 1 8 32 128, prompts 128 1024, 128 tokens,
one timed run; HF on unless ``--no-hf``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from asyncstep.bench.latency import kv_blocks as _kv_blocks
from asyncstep.bench.results import machine_info as _machine_info
from asyncstep.cli import engine_flag
from asyncstep.cli import main as cli_main
from asyncstep.config import engine_options

RESULTS_DIR = Path(__file__).parent / "results" / "bench"
BLOCK_SIZE = 16


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
    """``--engine-opt KEY=VALUE`` (repeatable), for the other scripts here:
    ``args.engine_opt`` is the list of (key, value) pairs from :func:`engine_opt`."""
    parser.add_argument(
        "--engine-opt", type=engine_opt, action="append", default=[], metavar="KEY=VALUE", help=help
    )


def kv_blocks(token_counts: Sequence[int]) -> int:
    """Blocks of 16 tokens for requests of these lengths, with 10 % headroom."""
    return _kv_blocks(list(token_counts), BLOCK_SIZE)


def machine_info(device: Any = None) -> dict[str, Any]:
    """The machine, as ``asyncstep bench`` records it (``device``: unused)."""
    info: dict[str, Any] = msgspec.to_builtins(_machine_info())
    return info


def engine_opt_flags(key: str, value: Any) -> list[str]:
    """The ``asyncstep`` flags of ``--engine-opt KEY=VALUE``."""
    option = engine_options().get(key)
    if option is None:
        raise SystemExit(f"bench.py: error: --engine-opt {key}: not an engine option")
    flag = engine_flag(key)
    if option.value_type is bool and isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    if value is None:
        return [flag, "none"]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("latency", "throughput", "floor"):
        p = sub.add_parser(mode)
        p.add_argument("--shape", default="llama-1b")
        p.add_argument("--device")
        p.add_argument("--dtype")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--copy-gib", type=float)
        p.add_argument("--copy-repeats", type=int, default=20)
        p.add_argument("--out", type=Path)
        p.add_argument("--no-record", action="store_true", help="accepted, ignored")
        p.add_argument("--tp", type=int, default=1)
        if mode != "throughput":
            p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128])
            p.add_argument("--prompt-len", type=int, nargs="+", default=[128, 1024])
            p.add_argument("--output-len", type=int, default=128)
        else:
            p.add_argument("--num-requests", type=int, default=256)
            p.add_argument("--min-len", type=int, default=100)
            p.add_argument("--max-len", type=int, default=1024)
            p.add_argument("--hf-batch", type=int, default=64)
            p.add_argument("--trace-dir")
            p.add_argument("--no-busy", action="store_true")
        if mode == "floor":
            continue
        p.add_argument("--pp", type=int, default=1)
        p.add_argument("--cudagraph-mode")
        p.add_argument("--no-overlap", action="store_true")
        p.add_argument("--rank-gpus", type=int)
        p.add_argument("--engine-opt", type=engine_opt, action="append", default=[])
        p.add_argument("--ours-repeats", type=int, default=1)
        p.add_argument("--no-hf", action="store_true")
        p.add_argument("--hf-from")
        p.add_argument("--hf-compile", action=argparse.BooleanOptionalAction)
        p.add_argument("--hf-warmups", type=int, default=2)
        p.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def translate(args: argparse.Namespace) -> list[str]:
    """The ``asyncstep bench`` arguments of an old command line."""
    mode = "latency" if args.mode == "floor" else args.mode
    out = [mode, "--load-format", "dummy", "--model", args.shape, "--seed", str(args.seed)]
    out += ["--tp", str(args.tp), "--copy-repeats", str(args.copy_repeats)]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype)):
        out += [flag, value] if value is not None else []
    out += ["--copy-gib", str(args.copy_gib)] if args.copy_gib is not None else []
    if args.mode == "throughput":
        out += ["--num-prompts", str(args.num_requests), "--hf-batch", str(args.hf_batch)]
        out += ["--min-len", str(args.min_len), "--max-len", str(args.max_len)]
        out += ["--trace-dir", args.trace_dir] if args.trace_dir else []
        out += ["--no-gpu-busy"] if args.no_busy else []
    else:
        out += ["--batch-size", *map(str, args.batch), "--input-len", *map(str, args.prompt_len)]
        out += ["--output-len", str(args.output_len)]
    if args.mode == "floor":
        return [*out, "--floor-only"]
    out += ["--pp", str(args.pp), "--hf-warmups", str(args.hf_warmups)]
    out += ["--hf-repeats", str(args.repeats)]
    out += ["--cudagraph-mode", args.cudagraph_mode] if args.cudagraph_mode else []
    out += ["--no-overlap"] if args.no_overlap else []
    out += ["--rank-gpus", str(args.rank_gpus)] if args.rank_gpus is not None else []
    out += ["--num-iters", str(args.ours_repeats)] if mode == "latency" else []
    out += ["--no-hf"] if args.no_hf else ["--hf"]
    out += ["--hf-from", args.hf_from] if args.hf_from else []
    if args.hf_compile is not None:
        out += ["--hf-compile" if args.hf_compile else "--no-hf-compile"]
    for key, value in args.engine_opt:
        out += engine_opt_flags(key, value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bench = translate(args)
    out = args.out
    if out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        out = (
            RESULTS_DIR
            / f"{args.mode}_{args.shape}_{args.tp}x{getattr(args, 'pp', 1)}_{stamp}.json"
        )
    print("asyncstep bench " + " ".join(bench), file=sys.stderr, flush=True)
    return cli_main(["bench", *bench, "--output-json", str(out)])


if __name__ == "__main__":
    raise SystemExit(main())
