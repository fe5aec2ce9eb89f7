"""The HF transformers baseline of ``asyncstep bench latency|throughput --hf``:
``generate`` with a static KV cache on a random-weight model of the
benchmarked model's shape.

The model is built directly on the device in the benchmark's dtype from a
transformers config of the shape (:func:`asyncstep.models.hf_reference.hf_config`).
Compiled: ``generate`` auto-compiles its decode step with
``CompileConfig(mode="reduce-overhead", fullgraph=True)`` (HF's static-cache
recipe);
prefill runs eagerly. Greedy; ``min_new_tokens = max_new_tokens``, so no
request stops early on EOS.

Runs that should share compiled graphs share one static-cache shape: the cache
is sized by ``max_new_tokens``, and a shorter run keeps that size and stops
early through a stopping criterion (:func:`stop_after`). Imports torch.

HF never fails the benchmark: an error is recorded in place of its figures.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from asyncstep.models.config import ModelArchConfig
from asyncstep.models.hf_reference import hf_config

#: Token id that left-pads HF's batches (our random prompts use ids >= 3).
PAD_ID = 0
Row = dict[str, Any]


@dataclass(frozen=True)
class HfOptions:
    device: torch.device
    dtype: torch.dtype
    compile: bool
    warmups: int  # short runs per batch shape before timing
    repeats: int  # timed runs (median)
    skip: bool = False
    quote_from: Path | None = None  # take the figures from an earlier run's JSON

    @property
    def label(self) -> str:
        if self.quote_from is not None:
            return f"quoted from {self.quote_from}"
        if self.skip:
            return "skipped"
        how = "generate auto-compile (reduce-overhead, fullgraph)" if self.compile else "eager"
        return f"static cache, {how}"


# -- the model ------------------------------------------------------------------


def _transformers() -> Any:
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def build_model(arch: ModelArchConfig, options: HfOptions) -> Any:
    """transformers' causal LM of ``arch``'s shape, random weights, on the device."""
    transformers = _transformers()
    from packaging.version import Version

    # transformers 4.56 renamed from_config's ``torch_dtype`` to ``dtype``.
    renamed = Version(transformers.__version__) >= Version("4.56")
    dtype_kw = {"dtype" if renamed else "torch_dtype": options.dtype}
    with torch.device(options.device):
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(arch, pad_token_id=PAD_ID), **dtype_kw
        )
    model.eval()
    gen = model.generation_config
    gen.cache_implementation = "static"
    gen.pad_token_id = PAD_ID
    gen.do_sample = False
    # Compiled: generate's own auto-compile of the decode step (static cache,
    # torch.compile mode "reduce-overhead" = CUDA graphs); prefill runs eagerly.
    # (Compiling model.forward ourselves breaks: the cudagraph trees see the
    # static cache overwritten between invocations.)
    gen.disable_compile = not options.compile
    if options.compile:
        dynamo = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):  # one per (batch, length)
            if hasattr(dynamo, name):
                setattr(dynamo, name, max(getattr(dynamo, name), 64))
        gen.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    return model


def free_model(holder: list[Any]) -> None:
    """Drop the model ``holder`` holds (its only reference), its static cache
    and compiled graphs, and their memory pools."""
    holder.clear()
    gc.collect()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def with_model(arch: ModelArchConfig, options: HfOptions, work: Callable[[Any], Any]) -> Any:
    """Build the model, return ``work(model)``, free the model (before our engine runs)."""
    holder = [build_model(arch, options)]
    try:
        return work(holder[0])
    finally:
        free_model(holder)


def guarded(label: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn``'s result, or ``{"error": ...}`` (an HF failure must not lose our figures)."""
    try:
        return fn(*args, **kwargs)
    except Exception as error:
        print(f"  HF {label} failed: {type(error).__name__}: {error}", file=sys.stderr)
        return {"error": f"{type(error).__name__}: {error}"}


def quoted(path: Path, key: str) -> Row | None:
    """The HF figures of configuration ``key`` in an earlier run's JSON: an
    ``asyncstep bench`` record (a case's ``detail.hf``) or an older
    ``benchmarks/bench.py`` one, retired (a row's ``hf``)."""
    earlier = json.loads(path.read_text())
    found = [(c.get("name"), c.get("detail", {}).get("hf")) for c in earlier.get("cases", [])]
    found += [(r.get("key"), r.get("hf")) for r in earlier.get("rows", [])]
    date = earlier.get("started") or earlier.get("date")
    for name, hf in found:
        if name == key and hf and "error" not in hf:
            return {**hf, "source": f"quoted from {path} ({date})"}
    return None


# -- generate -------------------------------------------------------------------


def stop_after(length: int) -> Any:
    """Stopping criteria: stop once sequences are ``length`` tokens long (prompt included)."""
    transformers = _transformers()
    base: Any = transformers.StoppingCriteria

    class StopAfter(base):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            done = input_ids.shape[1] >= length
            batch = input_ids.shape[0]
            return torch.full((batch,), done, dtype=torch.bool, device=input_ids.device)

    return transformers.StoppingCriteriaList([StopAfter()])


def left_pad(
    prompts: Sequence[Sequence[int]], width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask of ``prompts``, left-padded to ``width``."""
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, cache_new: int, new: int
) -> float:
    """Seconds of one ``generate`` of ``new`` tokens (synchronized), with a
    static cache sized for ``cache_new`` new tokens."""
    criteria = stop_after(ids.shape[1] + new) if new < cache_new else None
    _sync(ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=cache_new,
            min_new_tokens=cache_new,
            do_sample=False,
            stopping_criteria=criteria,
        )
    _sync(ids.device)
    elapsed = time.perf_counter() - start
    if out.shape[1] - ids.shape[1] != new:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, not {new}")
    return elapsed


# -- latency --------------------------------------------------------------------


def latency(
    model: Any, prompts: Sequence[Sequence[int]], output_len: int, options: HfOptions
) -> Row:
    """ITL of one batch of equal-length prompts: (median time of ``output_len``
    new tokens - median time of 1) / (output_len - 1); one cache shape for both."""
    ids, mask = left_pad(prompts, max(len(p) for p in prompts), options.device)
    run = partial(timed_generate, model, ids, mask, output_len)
    for _ in range(options.warmups):  # compile, then record the CUDA graphs
        run(min(output_len, 8))
    full, one = [], []
    for _ in range(options.repeats):
        full.append(run(output_len))
        one.append(run(1))
    t_full, t_one = statistics.median(full), statistics.median(one)
    return {
        "itl_ms": (t_full - t_one) / max(output_len - 1, 1) * 1e3,
        "ttft_ms": t_one * 1e3,
        "full_s": full,
        "one_token_s": one,
    }


def latency_all(
    arch: ModelArchConfig,
    options: HfOptions,
    batches: dict[str, list[list[int]]],
    output_len: int,
) -> dict[str, Row | None]:
    """HF's figures per configuration key (``batches``: key -> its prompts)."""
    if options.quote_from is not None:
        return {key: quoted(options.quote_from, key) for key in batches}
    if options.skip:
        return dict.fromkeys(batches)

    def work(model: Any) -> dict[str, Row | None]:
        out: dict[str, Row | None] = {}
        for key, prompts in batches.items():
            row = guarded(key, latency, model, prompts, output_len, options)
            out[key] = row | {"source": options.label}
            print(
                f"  HF   {key}: ITL {row.get('itl_ms', float('nan')):.3f} ms",
                file=sys.stderr,
                flush=True,
            )
        return out

    error = {"error": "the HF model could not be built", "source": options.label}
    result: dict[str, Row | None] = guarded("model", with_model, arch, options, work)
    return dict.fromkeys(batches, error) if "error" in result else result


# -- throughput -----------------------------------------------------------------


def throughput(
    model: Any,
    prompts: Sequence[Sequence[int]],
    output_lens: Sequence[int],
    batch_size: int,
    options: HfOptions,
) -> Row:
    """Static batches of ``batch_size`` requests, left-padded, each run to its
    largest output length. Only the requested output tokens count as useful.

    Compiled, every batch is padded to the longest prompt of all and gets a
    cache sized for the largest output of all, so one compiled graph serves
    every batch (each still stops at its own largest output).
    """
    starts = range(0, len(prompts), batch_size)
    batches = [(prompts[i : i + batch_size], output_lens[i : i + batch_size]) for i in starts]
    one_shape = options.compile
    all_width, all_new = max(len(p) for p in prompts), max(output_lens)
    sizes = sorted({len(b) for b, _ in batches}) if one_shape else [1]
    for size in sizes:  # warm-up per batch shape (the last batch may be smaller)
        width = all_width if one_shape else min(8, len(prompts[0]))
        ids, mask = left_pad([p[-width:] for p in prompts[:size]], width, options.device)
        cache_new = all_new if one_shape else 2
        for _ in range(options.warmups):
            timed_generate(model, ids, mask, cache_new, min(8, cache_new))
    seconds, computed = 0.0, 0
    for batch, lens in batches:
        width = all_width if one_shape else max(len(p) for p in batch)
        ids, mask = left_pad(batch, width, options.device)
        seconds += timed_generate(model, ids, mask, all_new if one_shape else max(lens), max(lens))
        computed += len(batch) * max(lens)
    useful, prompt_tokens = sum(output_lens), sum(len(p) for p in prompts)
    return {
        "wall_s": seconds,
        "output_tok_s": useful / seconds,
        "total_tok_s": (useful + prompt_tokens) / seconds,
        "useful_output_tokens": useful,
        "computed_output_tokens": computed,
        "batch_size": batch_size,
        "padded_to_one_shape": one_shape,
        "note": "static batches run to their largest output; only requested tokens count",
    }


def throughput_run(
    arch: ModelArchConfig,
    options: HfOptions,
    key: str,
    prompts: Sequence[Sequence[int]],
    output_lens: Sequence[int],
    batch_size: int,
) -> Row | None:
    if options.quote_from is not None:
        return quoted(options.quote_from, key)
    if options.skip:
        return None

    def work(model: Any) -> Row:
        return guarded(key, throughput, model, prompts, output_lens, batch_size, options)

    row: Row = guarded("model", with_model, arch, options, work)
    row["source"] = options.label
    print(
        f"  HF   {key}: {row.get('output_tok_s', float('nan')):.1f} output tok/s",
        file=sys.stderr,
        flush=True,
    )
    return row
