"""The embedded SmolLM2-135M-Instruct end to end: greedy tokens equal
transformers' on the same weights (fp32, CPU), alone and batched, with and
without chunked prefill; and the text a user sees."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, load_model
from asyncstep.ops.cpu.dense import dense_matmul

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Explain in one sentence why the sky is blue, and mention the name of the effect.",
    "Hi",
]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def hf_greedy(hf_model: Any, prompt_ids: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def prompt_ids(smollm2: LoadedModel) -> list[list[int]]:
    tok = smollm2.tokenizer
    assert tok is not None
    return [
        tok(
            tok.apply_chat_template(chat(q), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_tokens(hf_smollm2: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf_smollm2, ids) for ids in prompt_ids]


async def generate_batched(
    engine: asyncstep.Engine, prompts: list[Any], params: SamplingParams
) -> list[asyncstep.Completion]:
    results: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        results[i] = await engine.generate(prompts[i], params)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return results


@pytest.mark.trio
async def test_greedy_equals_transformers_alone_and_batched(
    smollm2: LoadedModel, prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        for q, expected in zip(QUESTIONS, hf_tokens, strict=True):
            alone = await engine.generate(chat(q), GREEDY)
            assert alone.token_ids == expected, q
        batched = await generate_batched(engine, [chat(q) for q in QUESTIONS], GREEDY)
        assert [c.token_ids for c in batched] == hf_tokens
        # Same prompts as token ids give the same tokens (and share prefix-cache blocks).
        again = await generate_batched(engine, prompt_ids, GREEDY)
        assert [c.token_ids for c in again] == hf_tokens
        assert engine.statistics().prefix_cache_hit_rate > 0
        assert engine.statistics().kv_cache_usage == 0.0


@pytest.fixture(params=["default", "bfloat16"])
def packed_smollm2(request: pytest.FixtureRequest) -> LoadedModel:
    """The embedded model as a user gets it (dtype auto: float32 activations
    over the CPU library's 4-bit blocks where they run), and with bfloat16
    asked for."""
    name = "smollm2_default" if request.param == "default" else "smollm2_bf16"
    loaded: LoadedModel = request.getfixturevalue(name)
    return loaded


@pytest.mark.trio
async def test_the_default_gives_transformers_tokens(
    packed_smollm2: LoadedModel, hf_tokens: list[list[int]]
) -> None:
    """The default path (and bfloat16's: the LM head's logits stay float32)
    gives transformers' fp32 greedy tokens, alone and batched."""
    async with asyncstep.open_engine(packed_smollm2) as engine:
        for q, expected in zip(QUESTIONS, hf_tokens, strict=True):
            alone = await engine.generate(chat(q), GREEDY)
            assert alone.token_ids == expected, q
        batched = await generate_batched(engine, [chat(q) for q in QUESTIONS], GREEDY)
        assert [c.token_ids for c in batched] == hf_tokens


@pytest.mark.trio
async def test_the_default_in_two_pipeline_stages_gives_transformers_tokens(
    hf_tokens: list[list[int]],
) -> None:
    """``--pp 2`` at the default (each stage a process loading the embedded
    model as a user gets it, gloo between them): transformers' fp32 greedy
    tokens, batched."""
    async with asyncstep.open_engine(device="cpu", pipeline_parallel_size=2) as engine:
        batched = await generate_batched(engine, [chat(q) for q in QUESTIONS], GREEDY)
    assert [c.token_ids for c in batched] == hf_tokens


#: Other requests to run beside the questions: prompts of different lengths.
NEIGHBOURS = [f"Tell me about the number {i} and what it means." * (1 + i % 4) for i in range(30)]


def tokens_and_logprobs(completion: asyncstep.Completion) -> tuple[list[int], list[Any]]:
    """A completion's tokens and log-probs, to compare bit for bit."""
    logprobs = [(p.token_ids, p.logprobs) for p in completion.logprobs or []]
    return completion.token_ids, logprobs


#: Greedy, with the sampled token's log-prob and the top one's.
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)


async def alone_and_among_30(
    engine: asyncstep.Engine, params: SamplingParams
) -> tuple[list[Any], list[Any]]:
    """The questions' tokens and log-probs alone, then among 30 others."""
    alone = [tokens_and_logprobs(await engine.generate(chat(q), params)) for q in QUESTIONS]
    crowd = [chat(q) for q in NEIGHBOURS[:15]] + [chat(q) for q in QUESTIONS]
    crowd += [chat(q) for q in NEIGHBOURS[15:]]
    among = await generate_batched(engine, crowd, params)
    return alone, [tokens_and_logprobs(c) for c in among[15 : 15 + len(QUESTIONS)]]


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
        alone, among = await alone_and_among_30(engine, GREEDY_LOGPROBS)
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
    async with asyncstep.open_engine(loaded) as engine:
        alone, among = await alone_and_among_30(engine, DENSE_GREEDY_LOGPROBS)
    assert among == alone


#: Engine options under which the default's tokens and log-probs stay those
#: of a plain run: a KV pool that preempts the crowd, overlap, speculation.
STEP_VARIANTS: dict[str, dict[str, Any]] = {
    "preempted": {"block_size": 16, "num_blocks": 40},
    "overlap": {"async_scheduling": True},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
}


@pytest.mark.trio
@pytest.mark.parametrize("variant", list(STEP_VARIANTS))
async def test_the_default_s_tokens_and_log_probs_survive_preemption_overlap_and_speculation(
    smollm2_default: LoadedModel, variant: str
) -> None:
    """The default (float32 activations over the 4-bit blocks): a question
    alone and among 30, preempted and recomputed, with overlap, verified
    with n-gram drafts: a plain engine's greedy tokens and log-probs, bit for
    bit (benchmarks/studies/invariance: the same holds for seeded sampling
    without speculation)."""
    async with asyncstep.open_engine(smollm2_default) as engine:
        plain, _ = await alone_and_among_30(engine, GREEDY_LOGPROBS)
    async with asyncstep.open_engine(smollm2_default, **STEP_VARIANTS[variant]) as engine:
        alone, among = await alone_and_among_30(engine, GREEDY_LOGPROBS)
        stats = engine.statistics()
    assert alone == plain and among == plain
    if variant == "preempted":
        assert stats.num_preemptions > 0
    if variant == "ngram":
        assert stats.spec_decode_num_drafts > 0


@pytest.mark.trio
async def test_chunked_prefill_and_small_batches_give_the_same_tokens(
    smollm2: LoadedModel, hf_tokens: list[list[int]]
) -> None:
    async with asyncstep.open_engine(
        smollm2, max_num_batched_tokens=16, max_num_seqs=3, enable_prefix_caching=False
    ) as engine:
        batched = await generate_batched(engine, [chat(q) for q in QUESTIONS], GREEDY)
        assert [c.token_ids for c in batched] == hf_tokens


@pytest.mark.trio
async def test_capital_of_france_and_the_text(smollm2: LoadedModel) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        out = await engine.generate(chat(QUESTIONS[0]), GREEDY)
        assert "Paris" in out.text
        assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
        tok = smollm2.tokenizer
        assert tok is not None
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        # Streaming gives the same text and tokens, chunk by chunk.
        chunks = [c async for c in engine.stream(chat(QUESTIONS[0]), GREEDY)]
        assert "".join(c.text for c in chunks) == out.text
        assert [t for c in chunks for t in c.token_ids] == out.token_ids
        assert chunks[-1].finish_reason == "stop" and all(
            c.finish_reason is None for c in chunks[:-1]
        )


@pytest.mark.trio
async def test_stop_strings_and_stop_tokens(smollm2: LoadedModel) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        full = await engine.generate(chat(QUESTIONS[0]), GREEDY)
        cut = await engine.generate(
            chat(QUESTIONS[0]), SamplingParams(temperature=0, max_tokens=24, stop=("Paris", "zzz"))
        )
        assert cut.text == full.text[: full.text.index("Paris")]
        assert cut.finish_reason == "stop" and cut.stop_reason == "Paris"
        kept = await engine.generate(
            chat(QUESTIONS[0]),
            SamplingParams(
                temperature=0, max_tokens=24, stop="Paris", include_stop_str_in_output=True
            ),
        )
        assert kept.text.endswith("Paris") and kept.text in full.text
        # A stop token id (the second token generated) ends the output after it.
        stop_id = full.token_ids[1]
        by_id = await engine.generate(
            chat(QUESTIONS[0]),
            SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]),
        )
        assert by_id.token_ids == full.token_ids[:2] and by_id.stop_reason == stop_id
        # ignore_eos runs to max_tokens.
        long = await engine.generate(
            chat(QUESTIONS[0]), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )
        assert len(long.token_ids) == 12 and long.finish_reason == "length"
        assert engine.statistics().kv_cache_usage == 0.0


@pytest.mark.trio
async def test_seeded_sampling_is_reproducible(smollm2: LoadedModel) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    async with asyncstep.open_engine(smollm2) as engine:
        first = await engine.generate("Once upon a time", params)
        # Batched with other requests, the seeded one still gives the same tokens.
        others = SamplingParams(temperature=1.0, max_tokens=16)
        batch = await generate_batched(
            engine,
            ["Once upon a time", "The weather today", "Once upon a time"],
            params,
        )
        assert batch[0].token_ids == first.token_ids == batch[2].token_ids
        other = await engine.generate(
            "Once upon a time", SamplingParams(**{**_fields(params), "seed": 99})
        )
        assert other.token_ids != first.token_ids
        await engine.generate("Hello", others)


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in params.__struct_fields__}


# -- bfloat16 ------------------------------------------------------------------

#: How far (nats) bfloat16 logits may put transformers' fp32 greedy token
#: below their top one: two of bfloat16's steps for logits in [16, 32) (one
#: in [32, 64)). Every question passes a near tie on its way (fp32 margins
#: from 0.04 nats), which bfloat16 rounding tips either way.
TIE_NATS = 0.25


@pytest.mark.trio
async def test_dense_bfloat16_against_transformers(
    prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    """Dense bf16 weights (rounded from the GGUF's 4-bit values) with a float32
    residual stream and float32 logits (the CPU's ``dtype=auto`` for a dense
    model where it multiplies bf16) against transformers' fp32 greedy tokens
    on the unrounded weights: walked along them (their tokens
    as our prompt), each is our top one or within :data:`TIE_NATS` of it; and
    our own greedy tokens are theirs up to the first place they part, where
    theirs is within :data:`TIE_NATS` of ours (a decode step's logits)."""
    loaded = load_model(ModelConfig(device="cpu", dtype="bfloat16", weight_packing="none"))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    async with asyncstep.open_engine(loaded) as engine:
        for question, ids, theirs in zip(QUESTIONS, prompt_ids, hf_tokens, strict=True):
            forced = await engine.generate(
                ids + theirs, SamplingParams(max_tokens=1, prompt_logprobs=1)
            )
            assert forced.prompt_logprobs is not None
            for at in forced.prompt_logprobs[len(ids) :]:  # their token's, then our top one
                assert at is not None and max(at.logprobs) - at.logprobs[0] <= TIE_NATS, question
            ours = await engine.generate(ids, greedy)
            parted = next(
                (k for k, (a, b) in enumerate(zip(ours.token_ids, theirs, strict=False)) if a != b),
                None,
            )
            if parted is None:
                assert ours.token_ids == theirs, question
                continue
            assert ours.logprobs is not None
            at = ours.logprobs[parted]
            top = dict(zip(at.token_ids, at.logprobs, strict=True))
            assert theirs[parted] in top, question
            assert top[ours.token_ids[parted]] - top[theirs[parted]] <= TIE_NATS, question
