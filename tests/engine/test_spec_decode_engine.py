"""Speculative decoding through the whole engine (n-gram drafts, the
rejection sampler, the scheduler's rollback, the front end's stop strings):
greedy output with speculation equals greedy output without, token for
token and in text, on prompts that repeat their context and prompts that
do not, several requests at once, with overlap asked for or not (a
speculative engine runs one step at a time), with stop strings, stop
tokens and ``max_tokens`` landing inside an accepted run, with prefix
caching, preemption and an abort; no block leaked.

The model is a small random Llama with SmolLM2's tokenizer whose greedy
text repeats tokens for a while (the n-gram drafts are often accepted, and
sometimes not) and whose logits are far from ties (a verify step's
reduction order cannot flip a token): ``looping_hf_dir``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams

ENGINE: dict[str, Any] = dict(
    device=os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu"),
    dtype="float32",
    num_blocks=256,
)
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
PROMPTS = [
    # Repeating their context.
    "Rewrite this: the cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2",
    # Not.
    "Once upon a time, in a land far away, there lived a",
    "Paris is the capital of",
    "Hello",
]
MAX_TOKENS = 24


@dataclass(frozen=True)
class Result:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


@pytest.fixture(scope="module")
def looping_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama with tied embeddings and SmolLM2's tokenizer:
    its greedy text repeats a token for a while, then moves on (n-gram
    drafts accepted, then rejected), and its top two logits are never
    within 2e-3 of each other on these prompts (checked with HF's
    ``generate``, 40 tokens each: seed 2 of a few tried), so a verify
    step's reduction order cannot flip a token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncstep.errors import ModelLoadError
    from asyncstep.models.loader import open_checkpoint

    saved = os.environ.get("ASYNCSTEP_TEST_TOKENIZER")
    try:
        tokenizer = open_checkpoint(None).load_tokenizer()
    except ModelLoadError as exc:  # the GPU machine has no embedded model; CPU runs must
        if os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu") == "cpu":
            raise
        if not saved:
            pytest.skip(f"needs SmolLM2's tokenizer (or ASYNCSTEP_TEST_TOKENIZER): {exc}")
        # SmolLM2's tokenizer saved by ``save_pretrained`` (a few MB, carried to
        # the GPU machine in place of the embedded model).
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(saved)
    torch.manual_seed(2)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    path = tmp_path_factory.mktemp("peaked-hf-spec")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


async def serve(
    path: Path,
    params: list[SamplingParams],
    *,
    spec: bool | dict[str, Any],
    prompts: list[str] = PROMPTS,
    abort_after: dict[int, int] | None = None,
    check_accepted: bool = True,
    preempts: bool | None = False,
    **options: Any,
) -> list[Result]:
    """Every prompt at once; a prompt in ``abort_after`` is cut by its caller
    after that many tokens. Checks every block came back, that requests were
    preempted if and only if ``preempts`` (None: either) and, with
    speculation (True: :data:`NGRAM`, or a ``speculative_config``), that
    drafts were accepted. Without speculation (the reference the speculative
    runs are compared with) the engine runs in this process: it starts in a
    fraction of the ~2 s an engine-core process takes, and its tokens are the
    same; the speculative runs keep the engine-core process."""
    abort_after = abort_after or {}
    results: list[Result | None] = [None] * len(prompts)
    if spec:
        if spec is True:
            options.setdefault("speculative_config", NGRAM)
        else:
            options["speculative_config"] = spec
    else:
        options.setdefault("engine_process", False)
    async with asyncstep.open_engine(path, **(ENGINE | options)) as engine:

        async def one(i: int) -> None:
            if i in abort_after:
                ids: list[int] = []
                async for chunk in engine.stream(prompts[i], params[i]):
                    ids += chunk.token_ids
                    if len(ids) >= abort_after[i]:
                        break  # leaving the stream aborts the request
                results[i] = Result(tuple(ids[: abort_after[i]]), "", "abort")
                return
            out = await engine.generate(prompts[i], params[i])
            results[i] = Result(tuple(out.token_ids), out.text, out.finish_reason)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        await engine.wait_idle()
        stats = engine.statistics()
        assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
        assert stats.kv_cache_usage == 0.0, "blocks leaked"
        if preempts is not None:
            assert (stats.num_preemptions > 0) == preempts
        if spec and check_accepted:
            assert stats.spec_decode_num_draft_tokens > 0
            assert stats.spec_decode_num_accepted_tokens > 0
            assert stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
            per_pos = stats.spec_decode_num_accepted_tokens_per_pos
            k = options["speculative_config"]["num_speculative_tokens"]
            assert len(per_pos) == k and sum(per_pos) == stats.spec_decode_num_accepted_tokens
        elif not spec:
            assert stats.spec_decode_num_draft_tokens == 0
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def greedy(max_tokens: int = MAX_TOKENS, **params: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **params)


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_greedy_output_is_the_same_with_and_without_speculation(
    looping_hf_dir: Path, overlap: bool
) -> None:
    params = [greedy()] * len(PROMPTS)
    options: dict[str, Any] = {"async_scheduling": overlap}
    if overlap:
        options["max_concurrent_batches"] = 2  # as on CUDA (ignored while speculating)
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False, **options))
    spec = trio.run(lambda: serve(looping_hf_dir, params, spec=True, **options))
    assert spec == plain


def test_stops_and_max_tokens_inside_accepted_runs(looping_hf_dir: Path) -> None:
    """Stop strings, stop tokens and max_tokens found from a plain run, at
    places a verify step covers; also with a small step budget (drafts
    trimmed, prompts chunked) and a tight cache (it may preempt)."""
    plain = trio.run(lambda: serve(looping_hf_dir, [greedy()] * len(PROMPTS), spec=False))
    text = plain[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick another stop string from {text!r}"
    params = [
        greedy(stop=(stop,)),
        greedy(stop_token_ids=[plain[1].token_ids[9]]),
        greedy(max_tokens=7),
        greedy(stop=(stop,), include_stop_str_in_output=True),
        greedy(max_tokens=3),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0], PROMPTS[0]]
    off = trio.run(lambda: serve(looping_hf_dir, params, spec=False, prompts=prompts))
    assert off[0].finish_reason == "stop" and len(off[0].token_ids) < MAX_TOKENS
    assert off[1].finish_reason == "stop" and len(off[1].token_ids) <= 10
    assert len(off[2].token_ids) == 7 and len(off[4].token_ids) == 3
    on = trio.run(lambda: serve(looping_hf_dir, params, spec=True, prompts=prompts))
    assert on == off
    small = trio.run(
        lambda: serve(looping_hf_dir, params, spec=True, prompts=prompts, max_num_batched_tokens=6)
    )
    assert small == off
    tight = trio.run(
        lambda: serve(
            looping_hf_dir,
            params,
            spec=True,
            prompts=prompts,
            block_size=4,
            num_blocks=14,
            preempts=None,  # (the outputs are short: preemption depends on arrivals)
        )
    )
    assert tight == off


def test_prefix_caching_preemption_and_an_abort(looping_hf_dir: Path) -> None:
    """The same prompts again hit the prefix cache (blocks registered by
    speculative steps must hold the accepted tokens' KV); a tight cache
    preempts; one request is aborted by its caller mid-run."""
    prompts = PROMPTS + PROMPTS[:2]
    params = [greedy(max_tokens=32)] * len(prompts)
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False, prompts=prompts))

    async def twice() -> tuple[list[Result], list[Result], float]:
        async with asyncstep.open_engine(
            looping_hf_dir, speculative_config=NGRAM, **(ENGINE | {"block_size": 4})
        ) as engine:
            first = [await engine.generate(p, params[0]) for p in prompts]
            again = [await engine.generate(p, params[0]) for p in prompts]
            hit_rate = engine.statistics().prefix_cache_hit_rate
        as_results = [
            [Result(tuple(o.token_ids), o.text, o.finish_reason) for o in outs]
            for outs in (first, again)
        ]
        return as_results[0], as_results[1], hit_rate

    first, again, hit_rate = trio.run(twice)
    assert first == again == plain
    assert hit_rate > 0.3
    tight = trio.run(
        lambda: serve(
            looping_hf_dir,
            params,
            spec=True,
            prompts=prompts,
            abort_after={2: 5},
            block_size=4,
            num_blocks=20,
            preempts=True,
        )
    )
    assert tight[2] == Result(plain[2].token_ids[:5], "", "abort")
    assert [r for i, r in enumerate(tight) if i != 2] == [r for i, r in enumerate(plain) if i != 2]


def test_seeded_sampling_with_speculation_repeats_and_ends_right(looping_hf_dir: Path) -> None:
    """Sampled requests speculate too (the rejection sampler's random rule):
    a seeded batch gives the same tokens twice, within max_tokens."""
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=MAX_TOKENS) for i in range(len(PROMPTS))
    ]
    first = trio.run(lambda: serve(looping_hf_dir, params, spec=True, check_accepted=False))
    second = trio.run(lambda: serve(looping_hf_dir, params, spec=True, check_accepted=False))
    assert first == second
    assert all(len(r.token_ids) <= MAX_TOKENS for r in first)


@pytest.mark.skipif(
    ENGINE["device"] == "cuda" and torch.cuda.device_count() < 2, reason="TP = 2 needs 2 GPUs"
)
def test_tensor_parallel_speculation_gives_the_single_ranks_tokens(looping_hf_dir: Path) -> None:
    """TP = 2 (two rank processes, gloo): every rank verifies the same
    drafts on the same logits; the tokens are the single rank's."""
    params = [greedy()] * len(PROMPTS)
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False))
    tp2 = trio.run(lambda: serve(looping_hf_dir, params, spec=True, tensor_parallel_size=2))
    assert tp2 == plain


def test_structured_outputs_verify_drafts_the_grammar_accepts(looping_hf_dir: Path) -> None:
    """A request with a grammar speculates too: its drafts are cut to what
    its matcher accepts, and the bitmask has a row per draft position (and
    the bonus position); beside requests without one. The same tokens as
    without speculation, in the grammar."""
    from asyncstep import StructuredOutputsParams

    choices = ["yes", "no", "maybe so"]
    pattern = r"(the cat sat on the mat\. ){4}"
    params = [greedy(max_tokens=40)] * len(PROMPTS)
    params[0] = greedy(max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern))
    params[2] = greedy(structured_outputs=StructuredOutputsParams(choice=choices))
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False))
    # (40 tokens end it before the 4th sentence: this model spells oddly.)
    assert plain[0].text.startswith("the cat sat on the mat. " * 2) and plain[2].text in choices

    async def constrained_alone() -> tuple[Result, int]:
        async with asyncstep.open_engine(
            looping_hf_dir, speculative_config=NGRAM, **ENGINE
        ) as engine:
            out = await engine.generate(PROMPTS[0], params[0])
            accepted = engine.statistics().spec_decode_num_accepted_tokens
        return Result(tuple(out.token_ids), out.text, out.finish_reason), accepted

    alone, accepted = trio.run(constrained_alone)
    assert alone == plain[0] and accepted > 0, "the grammar's drafts were verified"
    spec = trio.run(lambda: serve(looping_hf_dir, params, spec=True))
    assert spec == plain


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_n_choices_speculate_each(looping_hf_dir: Path, overlap: bool) -> None:
    """``n = 3`` greedy choices of a prompt: each is a request of its own in
    the core (their prompt cached once), each gives the greedy tokens;
    without overlap each speculates and drafts are accepted. (With overlap,
    the default on CUDA, this 24-token prompt gets few drafts: a request
    whose tokens are in flight is scheduled without drafts unless its known
    tokens already end with a recurring n-gram; on the CPU and on the H200
    2 drafts a choice, none accepted: only the tokens are asserted.)"""
    plain = trio.run(lambda: serve(looping_hf_dir, [greedy()], spec=False, prompts=PROMPTS[:1]))
    options = ENGINE | {"async_scheduling": overlap}

    async def choices() -> list[tuple[int, ...]]:
        async with asyncstep.open_engine(
            looping_hf_dir, speculative_config=NGRAM, **options
        ) as engine:
            out = await engine.generate(PROMPTS[0], greedy(n=3))
            stats = engine.statistics()
            assert stats.spec_decode_num_draft_tokens > 0
            if not overlap:
                assert stats.spec_decode_num_accepted_tokens > 0
            return [tuple(choice.token_ids) for choice in out.outputs]

    assert trio.run(choices) == [plain[0].token_ids] * 3


def test_verify_steps_through_the_graph_wiring(
    looping_hf_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton attention kernels and CUDA graphs (on the CPU the kernels
    interpreted and stand-in graphs), as on CUDA: FULL for uniform decodes,
    PIECEWISE for the rest: the same greedy tokens as without speculation.
    Verify steps where every request has all its ``k`` drafts run the FULL
    graph of ``1 + k`` tokens a request, their logits computed inside it;
    one-token decodes their own FULL graphs; the rest (a request with fewer
    drafts, prefills) PIECEWISE. (``k = 4`` here; the draft model's test
    runs the wiring with 3.)"""
    k = 4
    from asyncstep.runner.cudagraph_dispatcher import CUDAGraphMode
    from asyncstep.runner.cudagraph_runner import CudaGraphRunner

    pytest.importorskip("triton")
    replays: list[tuple[CUDAGraphMode, int, int | None, bool, bool]] = []
    run = CudaGraphRunner.run

    def spy(self: CudaGraphRunner, mode: CUDAGraphMode, desc: Any, meta: Any) -> Any:
        logits = self.computes_logits(mode, desc)
        replays.append((mode, desc.num_tokens, desc.num_reqs, desc.uniform_decode, logits))
        return run(self, mode, desc, meta)

    monkeypatch.setattr(CudaGraphRunner, "run", spy)
    # The two prompts that repeat their context and one that does not: verify
    # steps where both repeating ones have all their drafts, or one alone.
    prompts = PROMPTS[:2] + PROMPTS[-1:]
    params = [greedy(40)] * len(prompts)
    graphs = {
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "cudagraph_stand_in": ENGINE["device"] != "cuda",
        "attention_backend": "triton",
        "max_num_seqs": 8,
        "engine_process": False,  # the spy sees the runner's replays
    }
    spec_config = NGRAM | {"num_speculative_tokens": k}
    plain = trio.run(lambda: serve(looping_hf_dir, params, spec=False, prompts=prompts))
    spec = trio.run(
        lambda: serve(
            looping_hf_dir,
            params,
            spec=True,
            prompts=prompts,
            speculative_config=spec_config,
            **graphs,
        )
    )
    assert spec == plain
    q = 1 + k
    verify = [r for r in replays if r[0] is CUDAGraphMode.FULL and r[1] == q * (r[2] or 0)]
    from collections import Counter

    assert verify, Counter((r[0].name, r[1], r[2]) for r in replays)
    assert all(uniform and logits for _, _, _, uniform, logits in verify)
    decode = [r for r in replays if r[0] is CUDAGraphMode.FULL and r[1] == r[2]]
    assert decode and all(r[3] and r[4] for r in decode)
    assert any(r[0] is CUDAGraphMode.PIECEWISE for r in replays)
    assert len(verify) + len(decode) + sum(r[0] is CUDAGraphMode.PIECEWISE for r in replays) == (
        len(replays)
    )


def test_logprobs_of_every_accepted_token(looping_hf_dir: Path) -> None:
    """A request asking for log-probs speculates too: one entry per token,
    each the target's at that token's position (the same tokens, ranks and,
    within float tolerance, values as without speculation)."""
    params = [greedy(logprobs=3)] * len(PROMPTS)
    params[1] = greedy()  # a request without, beside

    async def run(spec: bool) -> tuple[list[Any], int]:
        options = {"speculative_config": NGRAM} if spec else {"engine_process": False}
        async with asyncstep.open_engine(looping_hf_dir, **(ENGINE | options)) as engine:
            outs = [await engine.generate(p, params[i]) for i, p in enumerate(PROMPTS)]
            return outs, engine.statistics().spec_decode_num_accepted_tokens

    plain, _ = trio.run(run, False)
    spec, accepted = trio.run(run, True)
    assert accepted > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        if a.logprobs is None:
            assert b.logprobs is None
            continue
        assert b.logprobs is not None and len(b.logprobs) == len(b.token_ids)
        for token, x, y in zip(b.token_ids, a.logprobs, b.logprobs, strict=True):
            assert y.token_ids[0] == token and x.token_ids == y.token_ids
            assert x.sampled_token_rank == y.sampled_token_rank == 1
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-4)
