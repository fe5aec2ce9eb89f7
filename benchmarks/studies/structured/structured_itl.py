"""Structured outputs benchmark: decode ITL with a grammar on every request
against none, in one run, and the bitmask's cost per step.

B requests (random prompts, 128 output tokens each) decode with
``structured_outputs`` off, then on (a JSON schema whose one string field
must be long, so every step is constrained inside a JSON string, the common
case; or ``--kind regex``). The model is a named shape with dummy weights and
a real tokenizer (``--tokenizer DIR``: the files of an HF tokenizer; the
grammar needs its vocabulary, and a dummy shape has none): the script writes
the shape's ``config.json`` next to a copy of the tokenizer. Reported per run,
over the steady decode steps: the device ITL (median gap between forward
starts, CUDA events), the wall ITL (untraced, ``--repeats`` runs), the engine
core's ``grammar`` span (the bitmask fill) per step, and whether it started
before the device's forward of the same step ended (it should: the fill runs
while the forward does). ``--trace-dir`` keeps the span logs and a timeline per run.

    python benchmarks/studies/structured/structured_itl.py --tokenizer TOKDIR \\
        --shape llama-1b --batch 1 32 \\
        --out benchmarks/results/structured/h200.json --trace-dir benchmarks/results/structured
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

import asyncstep
from asyncstep import SamplingParams, StructuredOutputsParams
from asyncstep.bench.measurement import add_engine_opt
from asyncstep.logging import configure_logging
from asyncstep.logging.trace import Span, draw_timeline, load_spans
from asyncstep.models.model_info import get_shape

sys.path.insert(0, str(Path(__file__).parent))
from asyncstep.bench.study import device_figures, make_prompts, write_results

#: One long string field: 128 tokens never close it (every step in a JSON string).
LONG_STRING_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
}
WORDS_REGEX = r"([a-z]+ )+"


def write_model_dir(shape: str, tokenizer: Path, out: Path) -> Path:
    """An HF checkpoint directory without weights (load it with dummy weights):
    ``shape``'s config.json and the tokenizer's files."""
    arch = get_shape(shape)
    out.mkdir(parents=True, exist_ok=True)
    for item in tokenizer.iterdir():
        if item.is_file() and not item.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy(item, out / item.name)
    config = {
        "architectures": [arch.architecture],
        "model_type": "llama",
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "eos_token_id": list(arch.eos_token_ids),
    }
    if arch.rope_scaling is not None:
        config["rope_scaling"] = arch.rope_scaling
    (out / "config.json").write_text(json.dumps(config))
    return out


def params_for(args: argparse.Namespace, constrained: bool) -> SamplingParams:
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    if not constrained:
        return params
    if args.kind == "json":
        structured = StructuredOutputsParams(json=LONG_STRING_SCHEMA)
    else:
        structured = StructuredOutputsParams(regex=WORDS_REGEX)
    return msgspec.structs.replace(params, structured_outputs=structured)


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (batch, free / grammar) configuration on one engine, in turn:
    each row holds its steps' range, wall time and bitmask statistics."""
    rows = []
    async with asyncstep.open_engine(
        str(args.model_dir),
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_seqs=max(args.batch),
        **dict(args.engine_opt),
    ) as engine:
        vocab = engine.arch_config.vocab_size
        for batch in args.batch:
            for constrained in (False, True):
                params = params_for(args, constrained)
                warm_up = make_prompts(min(vocab, 49152), 1, args.prompt_len, seed=99)[0]
                await engine.generate(warm_up, params)
                prompts = make_prompts(min(vocab, 49152), batch, args.prompt_len, seed=batch)
                first_step = engine.statistics().num_steps
                t0 = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for prompt in prompts:
                        nursery.start_soon(engine.generate, prompt, params)
                wall = time.perf_counter() - t0
                last_step = engine.statistics().num_steps
                rows.append(
                    {
                        "batch": batch,
                        "structured": constrained,
                        "first_step": first_step,
                        "last_step": last_step,
                        "wall_itl_ms": wall / (last_step - first_step) * 1e3,
                    }
                )
    return rows


def grammar_overlap(spans: list[Span], first_step: int) -> dict[str, float]:
    """The engine's ``grammar`` spans of steady steps: their mean length, and
    the fraction of them that started before their step's device forward ended."""
    forward = {s.step: s for s in spans if s.task == "device" and s.name == "forward"}
    grammar = [
        s for s in spans if s.name == "grammar" and s.step is not None and s.step >= first_step
    ]
    grammar = [s for s in grammar if s.step in forward]
    if not grammar:
        return {}
    inside = [s for s in grammar if s.ts_us < forward[s.step].end_us]
    return {
        "grammar_span_ms": statistics.mean(s.dur_us for s in grammar) / 1e3,
        "grammar_during_forward": len(inside) / len(grammar),
    }


def traced_figures(args: argparse.Namespace, rows: list[dict[str, Any]], log: Path) -> None:
    """Each row's device ITL (and grammar spans) from the traced run's spans."""
    spans = load_spans([log, *sorted(log.parent.glob(log.name + ".*"))])
    for row in rows:
        batch, first = row["batch"], row["first_step"]
        first_decode = first + -(-batch * args.prompt_len // 2048) + 2
        mine = [s for s in spans if s.step is not None and s.step < row["last_step"]]
        row.update(device_figures(mine, first_decode))
        if row["structured"]:
            row.update(grammar_overlap(mine, first_decode))
        mid = (first_decode + row["last_step"]) // 2
        label = f"{args.shape}_b{batch}_{'grammar' if row['structured'] else 'free'}"
        title = f"{args.shape} batch {batch}, {'grammar' if row['structured'] else 'free'}"
        draw_timeline(
            spans, log.parent / f"structured_{label}.png", steps=(mid, mid + 6), title=title
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True, help="an HF tokenizer's files")
    parser.add_argument("--shape", default="llama-1b")
    parser.add_argument("--kind", choices=["json", "regex"], default="json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--trace-dir", type=Path)
    add_engine_opt(parser)
    args = parser.parse_args()
    args.trace_dir = args.trace_dir or Path(tempfile.mkdtemp())
    args.trace_dir.mkdir(parents=True, exist_ok=True)
    args.model_dir = write_model_dir(args.shape, args.tokenizer, Path(tempfile.mkdtemp()))
    log = args.trace_dir / f"structured_{args.shape}.jsonl"
    configure_logging("warning", log, console=False)
    try:
        rows = trio.run(run_all, args)
    finally:
        configure_logging("warning", console=False)
    traced_figures(args, rows, log)
    for row in rows:  # wall ITL: untraced runs
        row["wall_itl_traced_ms"] = row.pop("wall_itl_ms")
        row["wall_itl_runs_ms"] = []
    for _ in range(args.repeats):
        for row, untraced in zip(rows, trio.run(run_all, args), strict=True):
            row["wall_itl_runs_ms"].append(untraced["wall_itl_ms"])
    for row in rows:
        row["wall_itl_ms"] = statistics.median(row["wall_itl_runs_ms"])
        extra = ""
        if row["structured"]:
            extra = (
                f", grammar span (the bitmask fill) "
                f"{row.get('grammar_span_ms', float('nan')):.3f} ms, during the forward "
                f"{row.get('grammar_during_forward', 0.0) * 100:.0f} %"
            )
        print(
            f"batch {row['batch']:3d} {'grammar' if row['structured'] else 'free   '}: ITL "
            f"{row['device_itl_ms']:.3f} ms (device), "
            f"{row['wall_itl_ms']:.3f} ms (wall){extra}",
            flush=True,
        )
    for batch in args.batch:
        free, grammar = (r for r in rows if r["batch"] == batch)
        print(
            f"batch {batch}: ITL grammar / free = "
            f"{grammar['device_itl_ms'] / free['device_itl_ms']:.3f} (device), "
            f"{grammar['wall_itl_ms'] / free['wall_itl_ms']:.3f} (wall)"
        )
    if args.out is not None:
        write_results(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
