"""Decode benchmark: async scheduling (overlap) on against off, in one run.

For each batch size, B requests (random prompts of ``--prompt-len`` tokens,
``ignore_eos``) decode ``--output-len`` tokens each, once with overlap on and
once off, on the same engine configuration (dummy weights of a named shape).
Reported per run, over the steady decode steps (every request decoding):

* inter-token latency (ITL): median gap between consecutive steps' forward
  starts, from CUDA event timestamps (device time);
* GPU busy: the fraction of the window from the first step's forward start
  to the last step's copy end during which a step's work (forward through
  sampling and the copy of its ids) occupied the device, from the same events;
* wall ITL: the batch's wall time / its steps, measured again with tracing
  off (``--repeats`` runs, median; the cost of tracing shows as the ratio).

The events come from the step-timeline spans (``asyncstep trace`` draws them);
``--trace-dir`` keeps the span logs and writes a timeline picture per run.

    python benchmarks/studies/overlap/overlap_decode.py --shape llama-1b --batch 1 32 \
        --out benchmarks/results/overlap_decode_h200.json --trace-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.bench.measurement import add_engine_opt
from asyncstep.bench.study import device_figures, make_prompts, write_results
from asyncstep.logging import configure_logging
from asyncstep.logging.trace import draw_timeline, load_spans, summarize

sys.path.insert(0, str(Path(__file__).parent))


async def run_batch(args: argparse.Namespace, batch: int, overlap: bool) -> dict[str, float]:
    """Serve one batch; returns wall-clock facts (the spans go to the log)."""
    async with asyncstep.open_engine(
        args.shape,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=max(batch, 1),
        async_scheduling=overlap,
        **dict(args.engine_opt),
    ) as engine:
        vocab = engine.arch_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        # Warm-up (allocator, kernels' first launch).
        await engine.generate(make_prompts(vocab, 1, args.prompt_len, seed=99)[0], params)
        prompts = make_prompts(vocab, batch, args.prompt_len)
        t0 = time.perf_counter()
        steps_before = engine.statistics().num_steps
        async with trio.open_nursery() as nursery:
            for prompt in prompts:
                nursery.start_soon(engine.generate, prompt, params)
        wall = time.perf_counter() - t0
        steps = engine.statistics().num_steps - steps_before
    return {"wall_s": wall, "steps": steps, "first_step": steps_before}


def measure(args: argparse.Namespace, batch: int, overlap: bool, trace_dir: Path) -> dict[str, Any]:
    log = trace_dir / f"overlap_{args.shape}_b{batch}_{'on' if overlap else 'off'}.jsonl"
    configure_logging("warning", log, console=False)
    try:
        traced = trio.run(run_batch, args, batch, overlap)
    finally:
        configure_logging("warning", console=False)
    spans = load_spans([log, *sorted(log.parent.glob(log.name + ".*"))])  # FILE.core too
    # Leave out the warm-up request, the batch's prefill steps and a ramp-up step.
    prefill_steps = -(-batch * args.prompt_len // 2048)
    first_decode = traced["first_step"] + prefill_steps + 2
    if args.summary:
        steady = [s for s in spans if s.step is not None and s.step >= first_decode]
        for key, row in summarize(steady).items():
            print(f"  b{batch} {'on' if overlap else 'off'} {key}: mean {row['mean_ms']:.3f} ms")
    figures = device_figures(spans, first_decode)
    if args.trace_dir is not None:
        steps = sorted(s.step for s in spans if s.step is not None)
        mid = steps[len(steps) * 3 // 4]
        draw_timeline(
            spans,
            log.with_suffix(".png"),
            steps=(mid, mid + 6),
            title=f"{args.shape} batch {batch}, overlap {'on' if overlap else 'off'}",
        )
    walls = []
    for _ in range(args.repeats):
        untraced = trio.run(run_batch, args, batch, overlap)
        walls.append(untraced["wall_s"] / untraced["steps"] * 1e3)
    return {
        "batch": batch,
        "overlap": overlap,
        **figures,
        "wall_itl_ms": statistics.median(walls),
        "wall_itl_runs_ms": walls,
        "wall_itl_traced_ms": traced["wall_s"] / traced["steps"] * 1e3,
        "trace_log": str(log) if args.trace_dir is not None else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--trace-dir", type=Path)
    parser.add_argument("--summary", action="store_true", help="print mean span times")
    parser.add_argument(
        "--repeats", type=int, default=3, help="untraced runs per configuration (median)"
    )
    parser.add_argument(
        "--switch-interval", type=float, help="sys.setswitchinterval (seconds) for the run"
    )
    add_engine_opt(parser)
    parser.add_argument("--overlap-only", action="store_true", help="skip the overlap-off runs")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp())
    trace_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch in args.batch:
        for overlap in (True,) if args.overlap_only else (True, False):
            row = measure(args, batch, overlap, trace_dir)
            rows.append(row)
            print(
                f"batch {batch:3d} overlap {'on ' if overlap else 'off'}: "
                f"ITL {row['device_itl_ms']:.3f} ms (device), {row['wall_itl_ms']:.3f} ms "
                f"(wall; traced {row['wall_itl_traced_ms']:.3f}), "
                f"GPU busy {row['gpu_busy'] * 100:.1f} % over {row['steady_steps']} steps",
                flush=True,
            )
    for batch in [] if args.overlap_only else args.batch:
        on, off = (r for r in rows if r["batch"] == batch)
        print(
            f"batch {batch}: ITL off/on = {off['device_itl_ms'] / on['device_itl_ms']:.3f}, "
            f"busy on {on['gpu_busy'] * 100:.1f} % vs off {off['gpu_busy'] * 100:.1f} %"
        )
    if args.out is not None:
        write_results(args.out, rows, switch_interval_s=sys.getswitchinterval())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
