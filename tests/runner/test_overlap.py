"""Async scheduling (overlap) on and off give the same outputs — greedy and
seeded sampling, EOS and stop strings reached mid-batch, a request aborted
mid-flight, no block leaked — for one rank and for PP = 2 x TP = 2 (gloo);
and the step timeline shows the overlap: the forward of step N+1 starts
before the output of step N is delivered."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.logging import configure_logging
from asyncstep.logging.trace import Span, load_spans

ENGINE: dict[str, Any] = dict(
    device=os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu"),
    dtype="float32",
    max_num_batched_tokens=24,
    num_blocks=128,
)
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "1 2 3 4 5",
    "Hello",
    "Paris is the capital of",
    "A long prompt that is prefilled in chunks because the step budget is small: "
    "one, two, three, four, five, six, seven.",
]
MAX_TOKENS = 16
ABORTED = 5  # the request aborted by its caller
ABORT_AFTER = 4  # tokens


@dataclass(frozen=True)
class Result:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


@pytest.fixture(scope="module")
def peaked_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama with large weights (logits far from ties, so
    layouts cannot flip a token) and SmolLM2's tokenizer (stop strings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncstep.errors import ModelLoadError
    from asyncstep.models.loader import open_checkpoint

    try:
        tokenizer = open_checkpoint(None).load_tokenizer()
    except ModelLoadError as exc:  # the GPU machine has no embedded model
        pytest.skip(f"needs SmolLM2's tokenizer: {exc}")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=2,
        bos_token_id=1,
    )
    path = tmp_path_factory.mktemp("peaked-hf")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def plain_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS),
    ]


def overlapped(overlap: bool) -> dict[str, Any]:
    """With overlap, two steps in flight, as on CUDA (on the CPU the engine
    keeps one by default)."""
    return {"max_concurrent_batches": 2} if overlap else {}


async def serve(
    path: Path,
    overlap: bool,
    params: list[SamplingParams],
    **options: Any,
) -> list[Result]:
    """Serve every prompt at once; the ABORTED one is cut by its caller after
    ABORT_AFTER tokens. Checks every block came back."""
    results: list[Result | None] = [None] * len(PROMPTS)
    options = overlapped(overlap) | options
    async with asyncstep.open_engine(path, async_scheduling=overlap, **ENGINE, **options) as engine:

        async def one(i: int) -> None:
            if i == ABORTED:
                ids: list[int] = []
                async for chunk in engine.stream(PROMPTS[i], params[i]):
                    ids += chunk.token_ids
                    if len(ids) >= ABORT_AFTER:
                        break  # leaving the stream aborts the request
                results[i] = Result(tuple(ids[:ABORT_AFTER]), "", "abort")
                return
            out = await engine.generate(PROMPTS[i], params[i])
            results[i] = Result(tuple(out.token_ids), out.text, out.finish_reason)

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
        await engine.wait_idle()
        stats = engine.statistics()
        assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
        assert stats.kv_cache_usage == 0.0, "blocks leaked"
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


@pytest.fixture(scope="module")
def stopping_params(peaked_hf_dir: Path) -> list[SamplingParams]:
    """Sampling parameters whose stops fire mid-batch, found from a plain run:
    a stop token that request 0 reaches at its 7th token, a stop string in
    the middle of request 2's text, a stop token of request 4."""
    plain = trio.run(serve, peaked_hf_dir, False, plain_params())
    assert all(len(r.token_ids) == MAX_TOKENS for r in plain[:ABORTED])
    text = plain[2].text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert stop.strip(), f"pick another stop string from {text!r}"
    params = plain_params()
    params[0] = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[plain[0].token_ids[6]]
    )
    params[2] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=(stop,))
    params[4] = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[plain[4].token_ids[9]]
    )
    return params


def check_stops_fired_mid_batch(results: list[Result]) -> None:
    assert results[0].finish_reason == "stop" and len(results[0].token_ids) <= 7
    assert results[2].finish_reason == "stop" and len(results[2].token_ids) < MAX_TOKENS
    assert results[4].finish_reason == "stop" and len(results[4].token_ids) <= 10
    assert len(results[ABORTED].token_ids) == ABORT_AFTER
    # Others ran on after those stopped.
    assert max(len(r.token_ids) for r in results) > min(len(r.token_ids) for r in results)


LAYOUTS = {
    "one rank": {},
    "one rank, 3 steps in flight": {"max_concurrent_batches": 3},
    "pp2xtp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}
_ON_CUDA = ENGINE["device"] == "cuda"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlap_on_and_off_give_the_same_outputs(
    layout: str,
    peaked_hf_dir: Path,
    stopping_params: list[SamplingParams],
) -> None:
    params = stopping_params
    if "pp2" in layout and _ON_CUDA and torch.cuda.device_count() < 4:
        pytest.skip("PP = 2 x TP = 2 on CUDA needs 4 GPUs")
    layout_serve = functools.partial(serve, **LAYOUTS[layout])
    off = trio.run(layout_serve, peaked_hf_dir, False, params)
    check_stops_fired_mid_batch(off)
    on = trio.run(layout_serve, peaked_hf_dir, True, params)
    assert on == off


# -- the timeline -------------------------------------------------------------


def by_step(spans: list[Span], task: str, name: str) -> dict[int, Span]:
    return {s.step: s for s in spans if s.task == task and s.name == name and s.step is not None}


def traced_run(path: Path, log: Path, overlap: bool) -> list[Span]:
    configure_logging("warning", log, console=False)
    try:
        params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 3
        trio.run(_generate, path, overlap, params)
    finally:
        configure_logging("warning", console=False)
    # The engine core (a process of its own) logs next to the caller: FILE.core.
    return load_spans([log, *sorted(log.parent.glob(log.name + ".*"))])


async def _generate(path: Path, overlap: bool, params: list[SamplingParams]) -> None:
    async with (
        asyncstep.open_engine(
            path, async_scheduling=overlap, **ENGINE, **overlapped(overlap)
        ) as engine,
        trio.open_nursery() as nursery,
    ):
        for prompt, p in zip(PROMPTS, params, strict=False):
            nursery.start_soon(engine.generate, prompt, p)


def overlapping_steps(spans: list[Span]) -> tuple[int, int]:
    """(steps N whose output waited for step N+1 to be launched — N+1 had
    reached the rank when N's tokens did —, of those the ones whose forward
    N+1 started before output N was delivered)."""
    output = by_step(spans, "sampler", "output")
    forward = by_step(spans, "device", "forward")
    # (A successor with no tokens, e.g. all requests done, runs no forward.)
    waited = [n for n in by_step(spans, "sampler", "wait_next_launch") if n + 1 in forward]
    overlapped = sum(forward[n + 1].ts_us < output[n].end_us for n in waited)
    return len(waited), overlapped


def test_timeline_shows_the_forward_of_step_n_plus_1_before_the_output_of_step_n(
    peaked_hf_dir: Path, tmp_path: Path
) -> None:
    spans = traced_run(peaked_hf_dir, tmp_path / "on.jsonl", overlap=True)
    ahead, overlapped = overlapping_steps(spans)
    # Steps scheduled one ahead are launched before the previous step's output
    # is handed out. (On the CPU the "device" is the launch thread, so a step's
    # tokens are ready the moment it returns: about every other step finds its
    # successor still on its way from the engine, and goes out at once.)
    assert ahead >= 3 and overlapped == ahead
    spans = traced_run(peaked_hf_dir, tmp_path / "off.jsonl", overlap=False)
    output = by_step(spans, "sampler", "output")
    forward = by_step(spans, "device", "forward")
    assert overlapping_steps(spans) == (0, 0)
    assert all(forward[n + 1].ts_us >= output[n].end_us for n in output if n + 1 in forward)
