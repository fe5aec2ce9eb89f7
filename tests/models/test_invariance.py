"""Batch invariance on the CPU default (issue 40's suite): a request's
tokens and log-probs, bit for bit, do not depend on what else runs in its
steps (alone against among 30 others), how its prompt is chunked, whether
its prefix came from the cache, whether it was preempted, overlap, n-gram
or draft-model speculation (greedy: plain decoding's tokens and
log-probs), two pipeline stages, and seeded sampling (temperature 0.8, a
seed per request: plain decoding's samples with speculation too). See
benchmarks/studies/invariance/README.md."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.loader import default_model_path
from asyncstep.models.model_loader import LoadedModel, load_model
from asyncstep.ops.cpu.dense import dense_matmul
from asyncstep.ops.cpu.dense_f32 import dense_f32_matmul
from tests.models.test_smollm2 import QUESTIONS, chat, generate_batched, packed_smollm2

__all__ = ["packed_smollm2"]  # the fixture, shared with test_smollm2

#: Other requests to run beside the questions: prompts of different lengths.
NEIGHBOURS = [f"Tell me about the number {i} and what it means." * (1 + i % 4) for i in range(30)]

#: Greedy, with the sampled token's log-prob and the top one's.
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)

Outputs = list[tuple[list[int], list[Any]]]


def tokens_and_logprobs(completion: asyncstep.Completion) -> tuple[list[int], list[Any]]:
    """A completion's tokens and log-probs, to compare bit for bit."""
    logprobs = [(p.token_ids, p.logprobs) for p in completion.logprobs or []]
    return completion.token_ids, logprobs


def seeded(i: int) -> SamplingParams:
    """Seeded sampling for question or neighbour ``i``: a seed of its own."""
    return SamplingParams(
        temperature=0.8, max_tokens=16, ignore_eos=True, logprobs=1, seed=1000 + i
    )


def params_of(params: SamplingParams | None, i: int) -> SamplingParams:
    return seeded(i) if params is None else params


async def alone_and_among_30(
    engine: asyncstep.Engine, params: SamplingParams | None = GREEDY_LOGPROBS
) -> tuple[Outputs, Outputs]:
    """The questions' tokens and log-probs alone, then among 30 others
    (``params`` None: each question and neighbour seeded on its own)."""
    alone = [
        tokens_and_logprobs(await engine.generate(chat(q), params_of(params, i)))
        for i, q in enumerate(QUESTIONS)
    ]
    prompts = [chat(q) for q in NEIGHBOURS[:15] + QUESTIONS + NEIGHBOURS[15:]]
    # Each request's seed is its own: the questions keep theirs (0..3).
    seeds = list(range(100, 115)) + list(range(len(QUESTIONS))) + list(range(115, 130))
    results: list[Any] = [None] * len(prompts)

    async def one(k: int) -> None:
        results[k] = await engine.generate(prompts[k], params_of(params, seeds[k]))

    async with trio.open_nursery() as nursery:
        for k in range(len(prompts)):
            nursery.start_soon(one, k)
    among = [tokens_and_logprobs(c) for c in results[15 : 15 + len(QUESTIONS)]]
    return alone, among


@pytest.fixture(scope="module")
def plain(smollm2_default: LoadedModel) -> Outputs:
    """The default's greedy questions alone, on a plain engine."""

    async def run() -> Outputs:
        async with asyncstep.open_engine(smollm2_default) as engine:
            alone, _ = await alone_and_among_30(engine)
        return alone

    return trio.run(run)


@pytest.mark.trio
@pytest.mark.parametrize("chunk", [None, 16])
async def test_a_request_s_tokens_do_not_depend_on_its_batch(
    packed_smollm2: LoadedModel, chunk: int | None
) -> None:
    """Alone, among 30 other requests, with its prompt chunked over steps or
    not, its prefix cached or not: the same greedy tokens and log-probs, bit
    for bit (one kernel for every step's size; every row computed on its own)."""
    options = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_num_seqs": 8}
    async with asyncstep.open_engine(packed_smollm2, **options) as engine:
        alone, among = await alone_and_among_30(engine)
        assert among == alone
        # Alone again: every prompt block but the last now comes from the cache.
        again = [
            tokens_and_logprobs(await engine.generate(chat(q), GREEDY_LOGPROBS)) for q in QUESTIONS
        ]
        assert again == alone and engine.statistics().prefix_cache_hit_rate > 0
    async with asyncstep.open_engine(
        packed_smollm2, enable_prefix_caching=False, **options
    ) as engine:
        uncached = await generate_batched(engine, [chat(q) for q in QUESTIONS], GREEDY_LOGPROBS)
        assert [tokens_and_logprobs(c) for c in uncached] == alone


#: Engine options under which the default's tokens and log-probs stay those
#: of a plain run: a KV pool that preempts the crowd, overlap, speculation
#: (n-gram drafts; the embedded model as its own draft model).
STEP_VARIANTS: dict[str, dict[str, Any]] = {
    "preempted": {"block_size": 16, "num_blocks": 40},
    "overlap": {"async_scheduling": True},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "draft_model": {
        "speculative_config": {
            "method": "draft_model",
            "model": str(default_model_path()),
            "num_speculative_tokens": 3,
        }
    },
}


@pytest.mark.trio
@pytest.mark.parametrize("variant", list(STEP_VARIANTS))
async def test_the_default_s_tokens_and_log_probs_survive_preemption_overlap_and_speculation(
    smollm2_default: LoadedModel, plain: Outputs, variant: str
) -> None:
    """The default (float32 activations over the 4-bit blocks): a question
    alone and among 30, preempted and recomputed, with overlap, verified
    with n-gram or a draft model's drafts: a plain engine's greedy tokens
    and log-probs, bit for bit."""
    async with asyncstep.open_engine(smollm2_default, **STEP_VARIANTS[variant]) as engine:
        alone, among = await alone_and_among_30(engine)
        stats = engine.statistics()
    assert alone == plain and among == plain
    if variant == "preempted":
        assert stats.num_preemptions > 0
    if variant in ("ngram", "draft_model"):
        assert stats.spec_decode_num_drafts > 0
    if variant == "draft_model":  # its own draft: every draft accepted
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


@pytest.mark.trio
async def test_two_pipeline_stages_give_one_rank_s_tokens_and_log_probs(plain: Outputs) -> None:
    """``--pp 2`` at the default (two processes, gloo between them): a
    question alone and among 30 gives the one-rank engine's greedy tokens
    and log-probs, bit for bit (each stage runs the same kernels on the
    same rows; the hidden state crosses as float32, unrounded)."""
    async with asyncstep.open_engine(device="cpu", pipeline_parallel_size=2) as engine:
        alone, among = await alone_and_among_30(engine)
    assert alone == plain and among == plain


#: Greedy with log-probs, a few tokens (dense bfloat16 runs layer by layer).
DENSE_GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.mark.trio
@pytest.mark.skipif(dense_matmul() is None, reason="no C compiler: F.linear's shape-dependent K")
async def test_dense_bfloat16_tokens_and_log_probs_do_not_depend_on_the_batch() -> None:
    """Dense bfloat16 weights (an HF checkpoint's path): every projection
    through the CPU library's matmul, one K order for every row count, so a
    question alone and among 30 others gets the same greedy tokens and
    log-probs, bit for bit (torch's oneDNN blocks K by the row count)."""
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", weight_packing="none"))
    # Asked for: where the library's build is not the fast one (AVX2) it is not the default.
    async with asyncstep.open_engine(loaded, batch_invariant=True) as engine:
        alone, among = await alone_and_among_30(engine, DENSE_GREEDY_LOGPROBS)
    assert among == alone


@pytest.mark.trio
@pytest.mark.skipif(
    dense_f32_matmul() is None, reason="no C compiler: F.linear's shape-dependent K"
)
async def test_dense_float32_tokens_and_log_probs_do_not_depend_on_the_batch() -> None:
    """Dense float32 weights (an HF checkpoint in float32): every projection
    and the LM head through the CPU library's float32 matmul, one K order
    for every row count, so a question alone and among 30 others gets the
    same greedy tokens and log-probs, bit for bit (torch's sgemm blocks K
    by the row count)."""
    loaded = load_model(ModelConfig(device="cpu", dtype="float32", weight_packing="none"))
    async with asyncstep.open_engine(loaded, batch_invariant=True) as engine:
        alone, among = await alone_and_among_30(engine, DENSE_GREEDY_LOGPROBS)
    assert among == alone


@pytest.fixture(scope="module")
def plain_seeded(smollm2_default: LoadedModel) -> Outputs:
    """The default's seeded questions alone, on a plain engine."""

    async def run() -> Outputs:
        async with asyncstep.open_engine(smollm2_default) as engine:
            return [
                tokens_and_logprobs(await engine.generate(chat(q), seeded(i)))
                for i, q in enumerate(QUESTIONS)
            ]

    return trio.run(run)


SEEDED_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 16, "max_num_seqs": 8},
    # Lookups of 1 to 3 tokens: drafts for the questions too, most of them rejected.
    "ngram": {
        "speculative_config": {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
    },
    "draft_model": STEP_VARIANTS["draft_model"],
}


@pytest.mark.trio
@pytest.mark.parametrize("case", list(SEEDED_CASES))
async def test_seeded_samples_do_not_depend_on_the_batch_or_on_speculation(
    smollm2_default: LoadedModel, plain_seeded: Outputs, case: str
) -> None:
    """Seeded sampling (temperature 0.8, a seed per request): alone, among
    30 other seeded requests, chunked, from the prefix cache, verified with
    n-gram or a draft model's drafts: a plain engine's samples and
    log-probs, bit for bit (vLLM's promise at temperature > 0; speculation
    replays plain decoding's draws: ``asyncstep.runner.seeded_drafts``)."""
    async with asyncstep.open_engine(smollm2_default, **SEEDED_CASES[case]) as engine:
        alone, among = await alone_and_among_30(engine, None)
        again = [
            tokens_and_logprobs(await engine.generate(chat(q), seeded(i)))
            for i, q in enumerate(QUESTIONS)
        ]
        stats = engine.statistics()
    assert alone == plain_seeded and among == plain_seeded and again == plain_seeded
    assert stats.prefix_cache_hit_rate > 0
    assert len({tuple(tokens) for tokens, _ in alone}) == len(QUESTIONS)
    if case in ("ngram", "draft_model"):
        assert stats.spec_decode_num_drafts > 0
