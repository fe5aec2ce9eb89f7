"""Grammar compile attacks at full size (issue 22, item 1), with the embedded
SmolLM2's vocabulary (49152 tokens), against the door's budget and the
engine core's compile pool.

    python benchmarks/studies/grammar/grammar_attacks.py \\
        --out benchmarks/results/grammar/attacks.json

Sections, each printed and kept in the JSON:

* ``door``: each attack (the issue's sizes: every body under 1 MB), and
  real-world grammars, through the door's check at the default budget: the
  refusal (one line) or pass, and the check's time.
* ``pool``: the same attacks with the budget off, so that they reach the
  compile pool at its default limits (CPU time, memory): what stops each
  one, after how long, and the worker's largest resident growth seen; the
  real-world grammars compiled through the pool (worker, then the core's
  build).
* ``interrupt``: whether a compile running in a thread can be stopped (an
  exception set on the thread is raised only once the compile returns).
* ``serialize``: xgrammar's ``CompiledGrammar.serialize_json`` /
  ``deserialize_json`` for small and large grammars, and the heap bytes a
  deserialized copy holds, and a compiled one (the cache counts
  ``memory_size_bytes``): why the core builds its own grammar rather than
  receive the worker's.

The machine's load average is recorded before and after (a shared machine
makes every time an upper bound).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from asyncstep.bench.study import write_results
from asyncstep.config import ModelConfig, StructuredOutputsConfig
from asyncstep.engine.structured_output.grammar import GrammarCompiler, check_grammar
from asyncstep.engine.structured_output.manager import StructuredOutputManager
from asyncstep.errors import InvalidRequestError
from asyncstep.models.model_info import describe_model
from asyncstep.structured_params import StructuredOutputsParams

VOCAB_SIZE = 49152


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def required_properties(count: int) -> dict[str, Any]:
    names = [f"p{i}" for i in range(count)]
    return {
        "type": "object",
        "properties": {n: {"type": "integer"} for n in names},
        "required": names,
    }


def tool_calls(tools: int, arguments: int) -> dict[str, Any]:
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f"tool_{t}"},
                    "arguments": {
                        "type": "object",
                        "properties": {
                            f"arg_{a}": {"type": ["string", "null"], "maxLength": 64}
                            for a in range(arguments)
                        },
                        "required": [f"arg_{a}" for a in range(arguments)],
                    },
                },
                "required": ["name", "arguments"],
            }
            for t in range(tools)
        ]
    }


def attacks() -> dict[str, dict[str, Any]]:
    """The issue's attacks at its sizes, and a short one the budget cannot see."""
    rng = random.Random(0)
    return {
        "regex of 100k alternatives": {"regex": "|".join(f"w{i}x" for i in range(100_000))},
        "choice of 1024 x 1000 characters": {
            "choice": ["".join(rng.choices("abcdefghij", k=1000)) for _ in range(1024)]
        },
        "schema of 25k required properties": {"json": required_properties(25_000)},
        "schema 400 deep (text)": {"json": json.dumps(nested(400))},
        "regex [^x]{1,100000} (14 bytes)": {"regex": "[^x]{1,100000}"},
    }


def real_world() -> dict[str, dict[str, Any]]:
    return {
        "tool calls 32 x 8 arguments": {"json": tool_calls(32, 8)},
        "tool calls 64 x 16 arguments": {"json": tool_calls(64, 16)},
        "form 32 deep": {"json": nested(32)},
        "form of 1500 properties": {"json": required_properties(1500)},
        "regex of 4000 labels": {"regex": "|".join(f"label_{i}" for i in range(4000))},
        "choice of 1024 x 54 characters": {
            "choice": [f"category {i}: " + "x" * 40 for i in range(1024)]
        },
        "json_object": {"json_object": True},
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


# -- door -----------------------------------------------------------------------


def door(specs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    budget = StructuredOutputsConfig()
    rows = []
    for name, spec in specs.items():
        params = StructuredOutputsParams(**spec)
        start = time.perf_counter()
        try:
            check_grammar(params, budget)
            outcome = "passed"
        except InvalidRequestError as exc:
            outcome = str(exc)
        seconds = time.perf_counter() - start
        rows.append({"grammar": name, "door_s": round(seconds, 4), "outcome": outcome})
        print(f"door  {name:36s} {seconds * 1e3:8.1f} ms  {outcome}", flush=True)
    return rows


# -- pool -----------------------------------------------------------------------


async def through_pool(
    tokenizer: Any, specs: dict[str, dict[str, Any]], config: StructuredOutputsConfig
) -> list[dict[str, Any]]:
    """Each grammar through a compile pool at ``config``'s limits (the door
    and its budget skipped), the worker's resident growth sampled meanwhile."""
    manager = StructuredOutputManager(lambda: tokenizer, VOCAB_SIZE, [2], config)
    rows = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(manager.run)
        warm = StructuredOutputsParams(choice=["yes", "no"])
        await manager.compile(warm, "warm")  # the worker starts (xgrammar's import)
        for name, spec in specs.items():
            rows.append(await _one(manager, name, StructuredOutputsParams(**spec)))
        nursery.cancel_scope.cancel()
    manager.close()
    return rows


async def _one(
    manager: StructuredOutputManager, name: str, params: StructuredOutputsParams
) -> dict[str, Any]:
    pool = manager.pool
    peak = {"growth": 0}
    done = trio.Event()

    async def sample() -> None:
        idle = {pid: rss_of(pid) for pid in pool.worker_pids}
        while not done.is_set():
            for pid in pool.worker_pids:
                idle.setdefault(pid, rss_of(pid))
                peak["growth"] = max(peak["growth"], rss_of(pid) - idle[pid])
            await trio.sleep(0.02)

    before = pool.statistics()
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        try:
            compiled = await manager.compile(params, "bench")
            outcome = f"compiled ({compiled.memory_size_bytes / 2**20:.2f} MiB)"
        except InvalidRequestError as exc:
            outcome = str(exc)
        done.set()
    seconds = time.perf_counter() - start
    after = pool.statistics()
    row = {
        "grammar": name,
        "wall_s": round(seconds, 2),
        "worker_growth_mib": round(peak["growth"] / 2**20, 1),
        "outcome": outcome,
        "workers_killed": after.num_workers_killed - before.num_workers_killed,
    }
    print(
        f"pool  {name:36s} {seconds:7.2f} s  worker +{row['worker_growth_mib']:6.1f} MiB  "
        f"{outcome}",
        flush=True,
    )
    return row


# -- interrupt ------------------------------------------------------------------


def interrupt(compiler: GrammarCompiler) -> dict[str, Any]:
    """Set an exception on a thread 0.1 s into its compile: when does it land?"""
    result: dict[str, Any] = {}

    def work() -> None:
        start = time.perf_counter()
        try:
            compiler.compile("regex", "[^x]{1,100000}")
            result["compile"] = "finished"
        except BaseException as exc:  # the exception set on the thread
            result["compile"] = f"raised {type(exc).__name__}"
        result["compile_s"] = round(time.perf_counter() - start, 2)

    thread = threading.Thread(target=work)
    thread.start()
    time.sleep(0.1)
    ident = ctypes.c_ulong(thread.ident or 0)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ident, ctypes.py_object(SystemExit))
    set_at = time.perf_counter()
    thread.join()
    result["exception_set_at_s"] = 0.1
    result["thread_ended_s_after_it"] = round(time.perf_counter() - set_at, 2)
    print(f"interrupt: {result}", flush=True)
    return result


# -- serialize ------------------------------------------------------------------


def serialize(compiler: GrammarCompiler, specs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    import xgrammar as xgr

    info = compiler.tokenizer_info
    rows = []
    for name, spec in specs.items():
        params = StructuredOutputsParams(**spec)
        compiled, compile_s = timed(lambda p=params: compiler.compile(p.kind, p.spec))
        text, serialize_s = timed(compiled.serialize_json)
        copy, deserialize_s = timed(lambda t=text: xgr.CompiledGrammar.deserialize_json(t, info))
        deserialized = _bytes_per_copy(lambda t=text: xgr.CompiledGrammar.deserialize_json(t, info))
        built = _bytes_per_copy(lambda p=params: compiler.compile(p.kind, p.spec))
        row = {
            "grammar": name,
            "compile_s": round(compile_s, 3),
            "memory_size_mib": round(compiled.memory_size_bytes / 2**20, 2),
            "json_mib": round(len(text) / 2**20, 2),
            "serialize_s": round(serialize_s, 3),
            "deserialize_s": round(deserialize_s, 3),
            "deserialized_heap_mib_per_copy": round(deserialized / 2**20, 2),
            "compiled_heap_mib_per_copy": round(built / 2**20, 2),
        }
        del compiled, copy, text
        gc.collect()
        rows.append(row)
        print(f"serialize {row}", flush=True)
    return rows


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use() -> int:
    """Bytes malloc has handed out and not had back (glibc's ``mallinfo2``):
    unlike the resident size, not hidden by memory freed earlier and reused."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _bytes_per_copy(make: Callable[[], Any], copies: int = 4) -> float:
    gc.collect()
    before = heap_in_use()
    kept = [make() for _ in range(copies)]
    grown = heap_in_use() - before
    del kept
    gc.collect()
    return grown / copies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sections", nargs="+", default=["door", "pool", "interrupt", "serialize"])
    args = parser.parse_args()
    facts: dict[str, Any] = {"load_average_before": load_average(), "cpus": os.cpu_count()}
    print(f"load average {facts['load_average_before']} on {os.cpu_count()} CPUs", flush=True)
    tokenizer = describe_model(ModelConfig()).tokenizer
    specs, usual = attacks(), real_world()
    results: dict[str, Any] = {}
    if "door" in args.sections:
        results["door"] = door({**specs, **usual})
    if "pool" in args.sections:
        config = StructuredOutputsConfig()
        facts["pool_limits"] = {
            "grammar_compile_timeout_s": config.grammar_compile_timeout_s,
            "grammar_compile_memory_mib": config.grammar_compile_memory_mib,
        }
        results["pool"] = trio.run(through_pool, tokenizer, {**specs, **usual}, config)
    compiler = GrammarCompiler.from_tokenizer(tokenizer, VOCAB_SIZE, [2], max_threads=1)
    if "interrupt" in args.sections:
        results["interrupt"] = interrupt(compiler)
    if "serialize" in args.sections:
        small = {k: usual[k] for k in ("json_object", "regex of 4000 labels")}
        large = {
            "schema of 300 required properties": {"json": required_properties(300)},
            "tool calls 32 x 8 arguments": usual["tool calls 32 x 8 arguments"],
            "choice of 1024 x 54 characters": usual["choice of 1024 x 54 characters"],
        }
        results["serialize"] = serialize(compiler, {**small, **large})
    facts["load_average_after"] = load_average()
    print(f"load average after: {facts['load_average_after']}", flush=True)
    if args.out is not None:
        rows = [
            {"section": section, **row}
            for section, found in results.items()
            for row in (found if isinstance(found, list) else [found])
        ]
        write_results(args.out, rows, **facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
