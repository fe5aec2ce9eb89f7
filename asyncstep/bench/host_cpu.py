"""CPU benchmark of the host path: asyncstep against HF transformers
``generate`` on the ``tiny-llama`` shape (random weights, fp32), in one run,
where the model is so small that the host's time per step is what counts.

Workload: ``--num-requests`` random prompts (seeded; lengths uniform in
``--prompt-len-range``, token ids in [3, vocab)), ``--output-len`` tokens each,
greedy, EOS ignored. The same prompts for both systems.

* **HF**: all requests as one left-padded batch through ``generate`` (static
  cache, eager, ``min_new_tokens = max_new_tokens``); one warm-up run, then
  ``--repeats`` timed runs, median.
* **ours**: ``open_engine("tiny-llama", load_format="dummy", device="cpu")``
  with room for every request at once (``max_num_seqs``, KV blocks) and the
  prompts in about two prefill steps; prefix caching off (every round computes
  what HF computes; ``--engine-opt enable_prefix_caching=true`` turns it on).
  Every request at once in one task group, through ``engine.generate`` and
  (``--streams``) through ``engine.stream``, reading every chunk, as services
  do. A warm-up round (a few requests), then ``--repeats`` timed rounds of each
  variant, interleaved; median.
* **busy caller**: the same generate rounds (``--busy-streams``: the stream
  rounds too) while one more task of the caller's event loop holds it
  ``--busy-ms`` at a time (busy-spins on ``perf_counter``, then
  ``await anyio.lowlevel.checkpoint()``: ``trio.sleep(0)``,
  ``asyncio.sleep(0)``), until the round ends; ``--busy-repeats`` rounds
  (they are the slow ones), median: tok/s and busy / undisturbed.
* **spans** (``--spans``, on by default; :mod:`~asyncstep.bench.host_spans`):
  one more engine, traced, one request alone, then all of them; per process,
  task and span name the mean µs per step over the steady decode steps (the
  first ``--skip-steps`` left out). Tracing costs time: the tok/s figures
  come from the untraced rounds only.

tok/s = num_requests x output_len / seconds of the round (prefill included).
Other work on the machine skews every figure: the other processes' CPU use
is recorded (``other_load``; per round ``other_cores``). The default run takes
about 1.5 minutes on 2 cores. Prints the tables; ``--out`` writes every
figure in ``asyncstep bench``'s results format (a case per system and
variant; the workload, ratios and spans in its ``extra``)::

    python3 -m asyncstep.bench.host_cpu --out FILE
    python3 -m asyncstep.bench.host_cpu --engine-opt engine_process=true
    python3 -m asyncstep.bench.host_cpu --backend asyncio --no-hf --no-spans --busy-streams

``--backend``: the caller's event loop, Trio (the default) or asyncio (through
AnyIO, as an asyncio service runs the engine).

This module is the study (options, workload, tables, record); the systems'
runners are :mod:`~asyncstep.bench.host_peers`', the other load
:mod:`~asyncstep.bench.host_load`'s. May import torch, anyio, msgspec,
asyncstep's public API and the ``asyncstep.bench`` modules named here.
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import anyio
import msgspec
import torch

import asyncstep
from asyncstep.bench import hf as bench_hf
from asyncstep.bench.host_load import cpu_seconds, other_load
from asyncstep.bench.host_peers import SHAPE, Row, engine_options, hf_run, ours_run
from asyncstep.bench.host_spans import spans_run
from asyncstep.bench.measurement import add_engine_opt, record, row_case
from asyncstep.bench.results import Result, machine_info, write
from asyncstep.models.dummy import get_shape


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--prompt-len-range", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX")
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed HF runs and rounds per variant (median)"
    )
    parser.add_argument(
        "--busy-repeats", type=int, default=3, help="timed busy-caller rounds (at most --repeats)"
    )
    parser.add_argument(
        "--warmup-requests", type=int, default=8, help="requests of our warm-up round"
    )
    parser.add_argument(
        "--streams",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time engine.stream (every chunk read)",
    )
    parser.add_argument(
        "--busy-ms",
        type=float,
        default=2.0,
        help="the busy caller holds the event loop this long at a time (0: no busy rounds)",
    )
    parser.add_argument(
        "--busy-streams",
        action="store_true",
        help="also time engine.stream with the busy caller (the slowest rounds: off by default)",
    )
    parser.add_argument(
        "--spans",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one traced round: host time per step by span",
    )
    parser.add_argument(
        "--skip-steps", type=int, default=4, help="steady decode steps left out at the start"
    )
    parser.add_argument("--trace-dir", type=Path, help="keep the span logs here")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument(
        "--backend",
        choices=("trio", "asyncio"),
        default="trio",
        help="the caller's event loop (asyncio through AnyIO)",
    )
    add_engine_opt(
        parser,
        "extra open_engine keyword (repeatable; overrides the sizing), e.g. engine_process=true",
    )
    parser.add_argument("--out", type=Path, help="write every figure here as JSON")
    args = parser.parse_args(argv)
    lo, hi = args.prompt_len_range
    if not 1 <= lo <= hi:
        parser.error("--prompt-len-range wants 1 <= MIN <= MAX")
    if min(args.num_requests, args.output_len, args.repeats, args.busy_repeats) < 1:
        parser.error("--num-requests, --output-len, --repeats and --busy-repeats must be >= 1")
    return args


# -- the workload ---------------------------------------------------------------


def make_prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``n`` prompts, lengths uniform in [lo, hi], token ids in [3, vocab)."""
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(n)]
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


# -- output ---------------------------------------------------------------------


def code_version() -> Row:
    """Where the asyncstep that ran lives, and its git commit (None outside a
    checkout) and whether its package files differ from that commit."""
    package = Path(asyncstep.__file__).resolve().parent

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(package), *argv], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--", ".") if commit else None
    return {"path": str(package), "git_commit": commit, "git_dirty": bool(changed)}


def fmt(value: float | None, spec: str) -> str:
    """``format(value, spec)``; ``-`` (as wide) when there is no value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        width = spec.split(".")[0]
        return format("-", f">{width}" if width.isdigit() else "")
    return format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return a / b


def ratios(result: Row) -> Row:
    hf = (result.get("hf") or {}).get("tok_s")
    ours = result["ours"]
    out: Row = {}
    for name in ("generate", "stream"):
        mine = (ours.get(name) or {}).get("tok_s")
        out[f"{name}_over_hf"] = ratio(mine, hf)
        out[f"busy_{name}_over_{name}"] = ratio((ours.get(f"busy_{name}") or {}).get("tok_s"), mine)
    return {key: value for key, value in out.items() if value is not None}


def print_tables(result: Row) -> None:
    w = result["workload"]
    print(
        f"\n{w['num_requests']} requests x {w['output_len']} tokens, prompts "
        f"{w['prompt_len_range'][0]}-{w['prompt_len_range'][1]} tokens, {SHAPE} fp32 on "
        f"{result['machine']['cpu_count']} CPU cores ({torch.get_num_threads()} torch threads),"
        f" the caller's loop {result['options']['backend']}"
    )
    other = result["other_load"]
    print(
        f"other processes used {fmt(other.get('other_cores'), '.2f')} cores on average"
        f" during the run (load average {other['load_average'][0]:.2f})"
    )
    hf = (result.get("hf") or {}).get("tok_s")
    r, ours = result["ratios"], result["ours"]
    header = f"{'':10} {'HF tok/s':>9} {'ours tok/s':>10} {'ours/HF':>8}"
    header += f" {'busy tok/s':>10} {'busy/undisturbed':>17}"
    print(header)
    for name in ("generate", "stream"):
        if name not in ours:
            continue
        busy = (ours.get(f"busy_{name}") or {}).get("tok_s")
        print(
            f"{name:10} {fmt(hf, '9.0f')} {ours[name]['tok_s']:10.0f}"
            f" {fmt(r.get(f'{name}_over_hf'), '8.2f')} {fmt(busy, '10.0f')}"
            f" {fmt(r.get(f'busy_{name}_over_{name}'), '17.2f')}"
        )
    spans = result.get("spans")
    if not spans:
        return
    for phase, table in spans["phases"].items():
        print(
            f"\nhost time per step by span, {phase.replace('_', ' ')} (traced;"
            f" {table['steps']} steady decode steps {table['first_step']}-{table['last_step']},"
            f" step period {fmt(table['step_period_us'], '.0f')} µs)"
        )
        print(f"{'process':8} {'task':8} {'span':18} {'µs/step':>9} {'count':>6} {'µs/span':>9}")
        for row in table["rows"]:
            print(
                f"{row['process']:8} {row['task']:8} {row['name']:18} {row['us_per_step']:9.1f}"
                f" {row['count']:6d} {row['us_per_span']:9.1f}"
            )
    print("(on the CPU, launch is the forward itself; the device spans overlap it)")


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> Row:
    """Every part of the benchmark; the result as written to ``--out``
    (``argv``: the command line's arguments, recorded)."""
    started = datetime.now(UTC)
    cpu_start, wall_start = cpu_seconds(), time.perf_counter()  # other work skews figures
    arch = get_shape(SHAPE)
    lo, hi = args.prompt_len_range
    prompts = make_prompts(arch.vocab_size, args.num_requests, lo, hi, args.seed)
    hf = None
    if not args.no_hf:
        hf = bench_hf.guarded("generate", hf_run, arch, prompts, args.output_len, args.repeats)
        print(f"  HF   generate: {fmt(hf.get('tok_s'), '.0f')} tok/s", flush=True)
    ours = anyio.run(ours_run, args, prompts, backend=args.backend)
    machine = msgspec.to_builtins(machine_info()) | {"torch_threads": torch.get_num_threads()}
    result: Row = {
        "command": "python3 -m asyncstep.bench.host_cpu " + shlex.join(argv),
        "argv": list(argv),
        "python": sys.executable,
        "date": started.isoformat(timespec="seconds"),
        "machine": machine,
        "asyncstep": code_version(),
        "options": vars(args),
        "workload": {
            "shape": SHAPE,
            "num_requests": args.num_requests,
            "output_len": args.output_len,
            "prompt_len_range": [lo, hi],
            "prompt_tokens": sum(len(p) for p in prompts),
            "output_tokens": args.num_requests * args.output_len,
            "seed": args.seed,
        },
        "engine_options": engine_options(args, prompts),
        "hf": hf,
        "ours": ours,
    }
    result["ratios"] = ratios(result)
    if args.spans:
        result["spans"] = spans_run(args, prompts)
    result["finished"] = datetime.now(UTC).isoformat(timespec="seconds")
    result["other_load"] = other_load(cpu_start, time.perf_counter() - wall_start)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    result = run(args, argv)
    print_tables(result)
    write(to_record(result), args.out)
    return 0


def to_record(result: Row) -> Result:
    """The run in ``asyncstep bench``'s results format: a case per system
    and variant (HF's ``generate``, ours by variant), the rest (the
    workload, the ratios, the spans, the other load) in ``extra``."""
    rows = [{"system": "hf", "variant": "generate", **result["hf"]}] if result["hf"] else []
    rows += [{"system": "asyncstep", "variant": k, **v} for k, v in result["ours"].items()]
    extra_keys = ("workload", "engine_options", "ratios", "spans", "other_load", "asyncstep")
    return record(
        "host_cpu",
        result["argv"],
        result["date"],
        options=result["options"],
        cases=[row_case(row, ["system", "variant"]) for row in rows],
        extra={key: result[key] for key in extra_keys if key in result}
        | {"torch_threads": result["machine"]["torch_threads"]},
    )


if __name__ == "__main__":
    raise SystemExit(main())
