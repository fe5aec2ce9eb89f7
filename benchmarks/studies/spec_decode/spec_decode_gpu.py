"""Speculative decoding on the GPU at batch 1 (issue 25): a dummy-weight
model shape (default llama-8b, bf16), one request at a time, greedy, with
and without n-gram speculation, and with speculation whose drafts are
always wrong (the acceptance-free overhead), in one run.

Variants, each a fresh engine of the same options, one after another; by
default in the caller's process (``engine_process=False``: the benchmark
swaps the scheduler's proposer, counts the steps per graph mode and can
profile), with ``--engine-process`` the engine core in its own process as
in production (the wrong proposer then goes in through a ``sitecustomize``
module that the core process, started with it on its ``PYTHONPATH``, runs
at its start; no step counts, no profile):

- ``off``: no ``speculative_config``;
- ``ngram_k{K}``: ``{"method": "ngram", "num_speculative_tokens": K,
  "prompt_lookup_min": 2, "prompt_lookup_max": 4}`` for each ``--k``;
- ``wrong_k{K}``: the same config, its proposer replaced by
  :class:`WrongDrafts` (benchmark-only): ``K`` drafts every step, never
  what the n-gram proposer would have proposed, so (the greedy output of
  dummy weights loops) nearly none is accepted; the acceptance rate is
  measured and printed with it;
- ``off`` again (``off_again``): the drift of the machine over the run;
- with ``--sync``: ``off_sync``, no speculation and ``async_scheduling``
  off (a speculative step runs alone in flight, without overlap: what the
  host's time between steps costs a step).

With ``--profile``, each variant also decodes one more request under
torch's profiler (CUPTI: the kernels of graph replays too), after its
timed ones: each kernel's device time a step, the sum, and the step's
wall time it did not fill (host time the device waited for).

The workload: prompts of ``--prompt-len`` token ids, a random block of
``--block`` tokens repeated (a prompt that repeats its context); greedy,
``ignore_eos``, ``--output-len`` tokens. Dummy greedy output tends to loop,
which is what makes n-gram drafts accepted here: the acceptance rate is
measured (the engine's counters), not assumed. Per variant: decode tok/s
(the tokens after the first over the time from the first to the last: a
prefill is the same with or without speculation), its ratio to ``off``,
the acceptance rate, the mean tokens a step, the steps per CUDA-graph mode
(``FULL`` / ``PIECEWISE`` / ``NONE``), and whether each output is token for
token the one without speculation. The floor: the weights (strict: the
input embedding's rows read, not the table) plus the mean context's KV,
read once a step, over the measured copy bandwidth.

    python3 benchmarks/studies/spec_decode/spec_decode_gpu.py --shape llama-8b --k 3 4 \\
        --out /tmp/spec.json
    # where a verify step's time goes:
    python3 benchmarks/studies/spec_decode/spec_decode_gpu.py --k 3 --sync --profile
    # a smoke run:
    python3 benchmarks/studies/spec_decode/spec_decode_gpu.py --shape tiny-llama --device cpu \\
        --output-len 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.models.dummy import dummy_weight_shapes, get_shape

#: The core process's ``sitecustomize`` (``--engine-process``): swaps in the
#: wrong-draft proposer where the variable says so, then runs any other
#: ``sitecustomize`` of the path.
_HOOK = """
import importlib.machinery, importlib.util, os, sys
_here = os.path.dirname(os.path.abspath(__file__))
_wrong = os.environ.get("ASYNCSTEP_BENCH_WRONG_DRAFTS")
if _wrong:
    from asyncstep.engine.spec_decode import ngram_proposer

    _k, _vocab = map(int, _wrong.split(":"))

    def _propose(self, request_id, token_ids, max_num_draft_tokens):
        last = int(token_ids[-1])
        return [(last + 1 + j) % _vocab for j in range(min(_k, max_num_draft_tokens))]

    ngram_proposer.NgramProposer.propose = _propose
_path = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _path)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
"""


_WRONG_VAR = "ASYNCSTEP_BENCH_WRONG_DRAFTS"


class _Entered:
    """Exits an already entered async context manager."""

    def __init__(self, manager: Any, value: Any) -> None:
        self.manager, self.value = manager, value

    async def __aenter__(self) -> Any:
        return self.value

    async def __aexit__(self, *exc: object) -> Any:
        return await self.manager.__aexit__(*exc)


class WrongDrafts:
    """A benchmark-only proposer: ``k`` drafts at every step (fewer only
    where the scheduler allows fewer), the tokens after the request's last
    one in id order (``last + 1, last + 2, ...``), never the n-gram
    proposer's: with a looping greedy output almost never the model's."""

    def __init__(self, k: int, vocab_size: int) -> None:
        self.k, self.vocab_size = k, vocab_size

    def propose(
        self, request_id: str, token_ids: Sequence[int], max_num_draft_tokens: int
    ) -> list[int]:
        k = min(self.k, max_num_draft_tokens)
        last = int(token_ids[-1])
        return [(last + 1 + j) % self.vocab_size for j in range(k)]

    def may_propose(self, request_id: str, token_ids: Sequence[int]) -> bool:
        return True  # drafts at every step

    def forget(self, request_id: str) -> None:
        pass


def repeating_prompts(
    vocab: int, length: int, block: int, count: int, seed: int
) -> list[list[int]]:
    """``count`` prompts of ``length`` ids: each a random block repeated."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        unit = [rng.randrange(3, vocab) for _ in range(block)]
        prompts.append((unit * (length // block + 1))[:length])
    return prompts


async def one_request(
    engine: asyncstep.Engine, prompt: list[int], output_len: int
) -> tuple[float, list[int]]:
    """(seconds from the first token to the last, the token ids)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    ids: list[int] = []
    first = None
    async for chunk in engine.stream(prompt, params):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
        ids += chunk.token_ids
    end = time.perf_counter()
    return end - (first or end), ids


def copy_bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write), median."""
    numel = int(gib * 2**30) // 2
    src = torch.randn(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 1):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            stop.record()
            stop.synchronize()
            seconds = start.elapsed_time(stop) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        if i:
            times.append(seconds)
    del src, dst
    return 2 * numel * 2 / statistics.median(times)


def floor_ms(args: argparse.Namespace, bandwidth: float) -> dict[str, float]:
    """One decode step's strict floor: every weight but the input embedding
    table (its one row instead), plus the mean context's KV, once."""
    arch = get_shape(args.shape)
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    shapes = dummy_weight_shapes(arch)
    weights = sum(math.prod(s) for s in shapes.values()) * itemsize
    embed = 0 if arch.tie_word_embeddings else math.prod(shapes["model.embed_tokens.weight"])
    context = args.prompt_len + args.output_len / 2
    kv = context * arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * itemsize
    strict = weights - embed * itemsize + arch.hidden_size * itemsize + kv
    return {
        "strict_floor_ms": strict / bandwidth * 1e3,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "bandwidth_tb_s": bandwidth / 1e12,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two outputs differ (None: the same)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def profile_request(
    engine: asyncstep.Engine, runner: Any, prompt: list[int], output_len: int
) -> dict[str, Any]:
    """One request under the profiler: device us a step per kernel name."""
    steps_before = sum(runner.step_inputs.cudagraph_steps.values())
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t, _ = await one_request(engine, prompt, output_len)
        torch.cuda.synchronize()
    steps = sum(runner.step_inputs.cudagraph_steps.values()) - steps_before - 1  # the prefill
    per_kernel: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] = per_kernel.get(event.name, 0.0) + event.device_time
    # Spread over the decode steps (the prefill's kernels are a small part).
    per_step = {k: v / max(steps, 1) for k, v in per_kernel.items()}
    top = sorted(per_step.items(), key=lambda kv: -kv[1])[:16]
    return {
        "decode_steps": steps,
        "wall_us_per_step": t / max(steps, 1) * 1e6,
        "device_us_per_step": sum(per_step.values()),
        "top_kernels_us_per_step": {k[:100]: round(v, 1) for k, v in top},
    }


async def run_variant(
    args: argparse.Namespace, name: str, spec: dict[str, Any] | None, wrong: bool
) -> dict[str, Any]:
    options: dict[str, Any] = {
        "load_format": "dummy",
        "device": args.device,
        "dtype": args.dtype,
        "engine_process": False,
        "max_num_seqs": 4,
        "max_model_len": args.prompt_len + args.output_len + 64,
        "max_num_batched_tokens": max(2048, args.prompt_len),
        "num_blocks": 4 * (-(-(args.prompt_len + args.output_len + 64) // 16)) + 16,
        "block_size": 16,
        "cudagraph_capture_sizes": [1, 2, 4, 8],
    }
    if spec is not None:
        options["speculative_config"] = spec
    if name.endswith("_sync"):
        options["async_scheduling"] = False
    if args.engine_process:
        options["engine_process"] = True
    for key, value in args.engine_opt:
        options[key] = value
    saved = {key: os.environ.get(key) for key in ("PYTHONPATH", _WRONG_VAR)}
    if wrong and args.engine_process:
        assert spec is not None
        hook = Path(tempfile.mkdtemp(prefix="spec_bench_hook"))
        (hook / "sitecustomize.py").write_text(_HOOK)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), saved["PYTHONPATH"]]))
        vocab_size = get_shape(args.shape).vocab_size
        os.environ[_WRONG_VAR] = f"{spec['num_speculative_tokens']}:{vocab_size}"
    try:
        engine_cm = asyncstep.open_engine(args.shape, **options)
        engine = await engine_cm.__aenter__()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    async with _Entered(engine_cm, engine):
        vocab = engine.arch_config.vocab_size
        core: Any = engine.core
        if wrong and not args.engine_process:
            assert spec is not None
            core.scheduler.drafts.proposer = WrongDrafts(spec["num_speculative_tokens"], vocab)
        warm = repeating_prompts(vocab, args.prompt_len, args.block, 1, args.seed + 99)[0]
        await one_request(engine, warm, min(32, args.output_len))  # kernels, graphs
        runner = None if args.engine_process else core.executor.runner
        steps_before = {} if runner is None else dict(runner.step_inputs.cudagraph_steps)
        before = engine.statistics()
        prompts = repeating_prompts(vocab, args.prompt_len, args.block, args.repeats, args.seed)
        seconds, tokens, outputs = 0.0, 0, []
        for prompt in prompts:
            await engine.wait_idle()
            t, ids = await one_request(engine, prompt, args.output_len)
            if len(ids) != args.output_len:
                raise RuntimeError(f"{name}: got {len(ids)} tokens, asked for {args.output_len}")
            seconds += t
            tokens += len(ids) - 1
            outputs.append(ids)
        after = engine.statistics()
        steps = {}
        if runner is not None:
            steps = {
                mode: count - steps_before.get(mode, 0)
                for mode, count in runner.step_inputs.cudagraph_steps.items()
            }
        profile = None
        if args.profile and runner is not None:
            profile = await profile_request(engine, runner, prompts[0], args.output_len)
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    # Steps from the engine's count where the runner is out of reach.
    num_steps = sum(steps.values()) or after.num_steps - before.num_steps
    return {
        "decode_tok_s": tokens / seconds,
        "ms_per_token": seconds / tokens * 1e3,
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        # The request's prefill step aside: the steps that made its tokens.
        "tokens_per_step": args.repeats * args.output_len / max(num_steps, 1),
        "steps_by_graph_mode": steps,
        "outputs": outputs,
        "profile": profile,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    variants: list[tuple[str, dict[str, Any] | None, bool]] = [("off", None, False)]
    for k in args.k:
        spec = {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 2,
            "prompt_lookup_max": 4,
        }
        variants.append((f"ngram_k{k}", spec, False))
    for k in args.wrong_k or args.k[:1]:
        spec = {"method": "ngram", "num_speculative_tokens": k}
        variants.append((f"wrong_k{k}", spec, True))
    variants.append(("off_again", None, False))
    if args.sync:
        variants.append(("off_sync", None, False))
    results: dict[str, Any] = {}
    for name, spec, wrong in variants:
        results[name] = await run_variant(args, name, spec, wrong)
        r = results[name]
        print(
            f"{name:>10}: {r['decode_tok_s']:8.1f} tok/s  {r['ms_per_token']:.3f} ms/token  "
            f"acceptance {r['acceptance_rate']:.3f} ({r['accepted_tokens']}/{r['draft_tokens']})  "
            f"{r['tokens_per_step']:.2f} tokens/step  steps {r['steps_by_graph_mode']}",
            flush=True,
        )
        if r["profile"] is not None:
            p = r["profile"]
            print(
                f"{'':>12}profile: {p['decode_steps']} steps, wall {p['wall_us_per_step']:.0f} us,"
                f" device {p['device_us_per_step']:.0f} us a step; top kernels:",
                flush=True,
            )
            for kernel, us in p["top_kernels_us_per_step"].items():
                print(f"{'':>14}{us:8.1f}  {kernel}", flush=True)
    off = statistics.mean([results["off"]["decode_tok_s"], results["off_again"]["decode_tok_s"]])
    reference = results["off"]["outputs"]
    for r in results.values():
        r["ratio_to_off"] = r["decode_tok_s"] / off
        same = sum(a == b for a, b in zip(r["outputs"], reference, strict=True))
        r["same_outputs_as_off"] = f"{same}/{len(reference)}"
        r["first_difference_from_off"] = [
            first_difference(a, b) for a, b in zip(r["outputs"], reference, strict=True)
        ]
        del r["outputs"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, nargs="+", default=[3, 4], help="num_speculative_tokens")
    parser.add_argument("--wrong-k", type=int, nargs="*", help="k of the wrong-draft runs")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--block", type=int, default=64, help="the prompt's repeated block")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="requests per variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        type=lambda s: (s.split("=", 1)[0], json.loads(s.split("=", 1)[1])),
        help="extra open_engine keyword KEY=JSON (repeatable)",
    )
    parser.add_argument(
        "--engine-process", action="store_true", help="the engine core in its own process"
    )
    parser.add_argument("--sync", action="store_true", help="also off without async scheduling")
    parser.add_argument("--profile", action="store_true", help="profile one request a variant")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 2.0 if device.type == "cuda" else 0.05)
    floor = floor_ms(args, bandwidth)
    print(f"floor: {json.dumps({k: round(v, 4) for k, v in floor.items()})}", flush=True)
    results = trio.run(run, args)
    base = 1e3 / floor["strict_floor_ms"]
    print(f"floor: {base:.1f} tok/s without speculation ({floor['strict_floor_ms']:.3f} ms a step)")
    for name, r in results.items():
        r["floor_tok_s_at_this_acceptance"] = base * r["tokens_per_step"]
        print(
            f"{name:>10}: x{r['ratio_to_off']:.3f} of off  {r['decode_tok_s']:.1f} tok/s  "
            f"floor at its tokens/step {r['floor_tok_s_at_this_acceptance']:.1f} tok/s  "
            f"same outputs {r['same_outputs_as_off']} "
            f"(first difference at {r['first_difference_from_off']})"
        )
    if args.out is not None:
        record = {
            "command": " ".join(["python3", *sys.argv]),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "floor": floor,
            "results": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
