"""Where a steady decode step's host time goes, on the CPU (issue 43).

The runner of the GPU path (FULL_AND_PIECEWISE graphs on their CPU
stand-in), driven by the real scheduler through steady decode steps of
``--batch`` requests (``--prompt-len`` prompts, ``--steps`` decode steps
measured after the prefill and a few warm-up steps), the synchronous loop:
``schedule`` -> ``execute_model`` -> ``sample_tokens`` -> ``get_output`` ->
``update_from_output``. The FULL graph's replay is a stub that returns
static logits (on CUDA it is one launch whose device time the host does not
wait for), so every figure is host time: the scheduler, the step's input
preparation (``prepare``: the persistent batch, the staged inputs, the
sampled ids' scatter), the replay's host side, the sampler, the output copy
and its bookkeeping. ``greedy_in_graph`` on and off alternate in blocks of
``--block`` steps, ``--repeats`` blocks each (interleaved: the machine's
other load hits both); the medians per step and their ratio.

    python3 benchmarks/studies/host/decode_host_split.py --batch 1 32 --out FILE.json

The shape is tiny-llama's (vocab 512): the sampler's kernels are its host
side only (on CUDA, the launches; here the CPU ops on 512 logits a row).
The torch attention backend's SDPA context (``reference_attention_backends``)
is left out: the GPU path's Triton backend never enters it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from asyncstep.config import CacheConfig, CompilationConfig, ModelConfig, SchedulerConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.core.request import Request
from asyncstep.engine.core.scheduler import Scheduler
from asyncstep.models.model_loader import load_model
from asyncstep.runner import model_runner as model_runner_module
from asyncstep.runner import step_sampling as step_sampling_module
from asyncstep.runner.async_output import AsyncModelRunnerOutput
from asyncstep.runner.cudagraph_dispatcher import CUDAGraphMode
from asyncstep.runner.cudagraph_runner import CudaGraphRunner
from asyncstep.runner.input_batch import InputBatch
from asyncstep.runner.model_runner import ModelRunner
from asyncstep.runner.persistent_batches import PersistentBatches
from asyncstep.runner.sampled_tokens import SampledTokens
from asyncstep.runner.sampler import Sampler
from asyncstep.runner.step_inputs import StepInputBuilder

BLOCK = 16
#: The parts timed (seconds summed per step): name -> (owner, attribute);
#: a part's time includes that of the parts it calls.
TIMED: dict[str, tuple[Any, str]] = {
    "schedule": (Scheduler, "schedule"),
    "execute_model": (ModelRunner, "execute_model"),
    "resolve": (SampledTokens, "resolve"),
    "batch_update": (PersistentBatches, "update"),
    "prepare": (StepInputBuilder, "prepare"),
    "load_inputs": (CudaGraphRunner, "load_inputs"),
    "scatter": (SampledTokens, "scatter"),
    "sample_tokens": (ModelRunner, "sample_tokens"),
    "sampling_metadata": (InputBatch, "sampling_metadata"),
    "sampler": (Sampler, "__call__"),
    "copy_to_host": (step_sampling_module, "copy_to_host"),
    "copy_to_host_in_order": (step_sampling_module, "copy_to_host_in_order"),
    "get_output": (AsyncModelRunnerOutput, "get_output"),
    "update_from_output": (Scheduler, "update_from_output"),
}
PARTS = ("replay", *TIMED)


def _any_mode(name: str, *args: Any, **kwargs: Any) -> CUDAGraphMode:
    return CUDAGraphMode.parse(name)


class Timers:
    """Seconds per part, summed over the current step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.step[name] += time.perf_counter() - t0

        return timed


@contextmanager
def instrumented(timers: Timers) -> Iterator[None]:
    """The parts timed, and the FULL graphs' replay a stub (static logits)."""
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, value: Any) -> None:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    run = CudaGraphRunner.run
    logits_cache: dict[int, torch.Tensor] = {}

    def stub_run(self: CudaGraphRunner, mode: CUDAGraphMode, desc: Any, meta: Any) -> Any:
        if mode is not CUDAGraphMode.FULL:
            return run(self, mode, desc, meta)
        n = desc.num_tokens
        if n not in logits_cache:
            logits_cache[n] = torch.randn(n, self.model.config.vocab_size)
        return logits_cache[n]

    patch(model_runner_module, "resolve_cudagraph_mode", _any_mode)
    # (the torch backend's SDPA choice, which the GPU path's Triton backend never enters)
    patch(model_runner_module, "reference_attention_backends", contextlib.nullcontext)
    patch(CudaGraphRunner, "run", timers.wrap("replay", stub_run))
    for name, (owner, attr) in TIMED.items():
        patch(owner, attr, timers.wrap(name, getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


class Loop:
    """A runner and its scheduler, ``batch`` requests decoding."""

    def __init__(self, args: argparse.Namespace, batch: int, greedy_in_graph: bool) -> None:
        loaded = load_model(
            ModelConfig(model=args.shape, load_format="dummy", device="cpu", dtype="float32")
        )
        max_model_len = args.prompt_len + args.max_tokens + 8
        blocks = batch * -(-max_model_len // BLOCK) + 8
        self.runner = ModelRunner(
            loaded.model,
            device=loaded.device,
            dtype=loaded.dtype,
            max_model_len=max_model_len,
            max_num_reqs=batch,
            block_size=BLOCK,
            compilation=CompilationConfig(
                cudagraph_mode="FULL_AND_PIECEWISE",
                attention_backend="torch",
                greedy_in_graph=greedy_in_graph,
                cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32],
            ),
            max_num_batched_tokens=2048,
            graph_stand_in=True,
        )
        self.runner.initialize_kv_cache(blocks)
        self.runner.capture_model()
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=batch),
            CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            blocks,
            max_model_len=max_model_len,
        )
        rng = np.random.default_rng(0)
        vocab = loaded.model.config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for i in range(batch):
            prompt = rng.integers(3, vocab, args.prompt_len).tolist()
            self.scheduler.add_request(Request(f"r{i}", prompt, params))

    def step(self) -> None:
        so = self.scheduler.schedule()
        out = self.runner.execute_model(so)
        if out is None:
            out = self.runner.sample_tokens()
        if isinstance(out, AsyncModelRunnerOutput):
            out = out.get_output()
        assert out is not None and not isinstance(out, torch.Tensor)
        self.scheduler.update_from_output(so, out)  # type: ignore[arg-type]


def measure(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    timers = Timers()
    with instrumented(timers), torch.inference_mode():
        loops = {on: Loop(args, batch, on) for on in (True, False)}
        for loop in loops.values():
            for _ in range(args.warmup):  # the prefill, then steady decode
                loop.step()
        per_step: dict[bool, dict[str, list[float]]] = {on: defaultdict(list) for on in loops}
        for _ in range(args.repeats):
            for on, loop in loops.items():
                for _ in range(args.block):
                    timers.step.clear()
                    t0 = time.perf_counter()
                    loop.step()
                    total = time.perf_counter() - t0
                    for part in PARTS:
                        per_step[on][part].append(timers.step.get(part, 0.0))
                    per_step[on]["step"].append(total)
        taken = loops[True].runner.sampling.num_graph_greedy_steps
        assert loops[False].runner.sampling.num_graph_greedy_steps == 0
    medians = {
        "on" if on else "off": {k: statistics.median(v) * 1e6 for k, v in parts.items()}
        for on, parts in per_step.items()
    }
    return {"batch": batch, "us_per_step": medians, "graph_greedy_steps": taken}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tiny-llama")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--block", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(args, batch) for batch in args.batch]
    for r in results:
        on, off = r["us_per_step"]["on"], r["us_per_step"]["off"]
        print(f"batch {r['batch']}: median us per step, greedy_in_graph off / on (on/off)")
        for part in ("step", *TIMED, "replay"):
            ratio = on[part] / off[part] if off[part] else float("nan")
            share = off[part] / off["step"]
            print(f"  {part:20s} {off[part]:8.1f} ({share:5.1%}) {on[part]:8.1f}  {ratio:5.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
