"""Penalties, logit bias, min_tokens and bad words (vLLM's names and meanings).

The sampler's processing against a pure-Python re-computation of vLLM's
rules, row by row (with the newest token known only to the device, as with
async scheduling); the batch without any of them keeps the old fast paths;
end to end, greedy tokens equal HF ``generate``'s with its logits processors
(repetition penalty, ``bad_words_ids``, ``sequence_bias``, ``min_new_tokens``,
and vLLM's presence/frequency formula as a custom processor) on a tiny
random checkpoint and on the embedded SmolLM2, overlap on and off; the
scheduler and the stop strings wait for ``min_tokens``.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.datatypes import FinishReason
from asyncstep.engine.front_end.detokenizer import IncrementalDetokenizer
from asyncstep.models.model_loader import LoadedModel
from asyncstep.runner.input_batch import _ALL_GREEDY, CachedRequestState, InputBatch
from asyncstep.runner.logits_processing import TokenHistory, apply_logits_processing
from asyncstep.runner.sampler import Sampler, SamplingMetadata
from tests.engine.test_scheduler import FakeRunner, drive, make_request, make_scheduler, scripted

CPU = torch.device("cpu")
NEG_INF = float("-inf")
MAX_TOKENS = 16


# ---------------------------------------------------------------------------
# The reference: vLLM's rules, one row at a time, in Python floats.


def reference_row(
    logits: Sequence[float],
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
) -> list[float]:
    """vLLM's processing of one row: bad words (the output's tail only),
    logit bias, min_tokens, then ``apply_penalties``."""
    x = [float(v) for v in logits]
    vocab = len(x)
    for word in params.bad_words_token_ids:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and (not prefix or list(output[-len(prefix) :]) == prefix):
            x[word[-1]] = NEG_INF
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output) < params.min_tokens:
        for token in params.min_tokens_stop_ids:
            if token < vocab:
                x[token] = NEG_INF
    for token in set(prompt) | set(output):
        penalty = params.repetition_penalty
        x[token] = x[token] / penalty if x[token] > 0 else x[token] * penalty
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count
        x[token] -= params.presence_penalty
    return x


def assert_rows_close(got: torch.Tensor, want: list[list[float]]) -> None:
    expected = torch.tensor(want, dtype=torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(got.double()[finite], expected[finite], rtol=1e-5, atol=1e-5)


def filled_batch(
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
    *,
    device_only_last: bool,
) -> tuple[InputBatch, list[int], list[int]]:
    """A persistent batch holding the requests; with ``device_only_last`` the
    host lacks each output's newest token (an output placeholder). Returns
    the batch, the rows' lengths and their newest tokens."""
    batch = InputBatch(max_num_reqs=8, max_model_len=64, block_size=16, device=CPU)
    seq_lens, last = [], []
    for i, (p, prompt, output) in enumerate(zip(params, prompts, outputs, strict=True)):
        known = output[:-1] if device_only_last and output else output
        state = CachedRequestState(f"r{i}", prompt, p, None, [], 0, list(known))
        batch.add_request(state)
        seq_lens.append(len(prompt) + len(output))
        last.append((prompt + output)[-1])
    return batch, seq_lens, last


def history_of(
    batch: InputBatch, seq_lens: list[int], last: list[int], rows: list[int]
) -> tuple[Any, TokenHistory | None]:
    metadata = batch.sampling_metadata(rows)
    if metadata.processing is None:
        return metadata, None
    history = batch.token_history(
        rows,
        np.asarray([seq_lens[r] for r in rows], dtype=np.int64),
        torch.tensor([last[r] for r in rows]),
        metadata.processing,
    )
    return metadata, history


VOCAB = 40
EOS = 3


Batch = tuple[list[SamplingParams], list[list[int]], list[list[int]]]


def mixed_batch(rng: random.Random) -> Batch:
    """Rows of every kind, with repeated tokens in prompts and outputs."""

    def tokens(n: int) -> list[int]:
        return [rng.randrange(12) for _ in range(n)]

    outputs = [tokens(rng.randrange(2, 9)) for _ in range(7)]
    outputs[4] = [9, 5, 7]  # the multi-token bad word (5, 7, x) matches its tail
    prompts = [tokens(rng.randrange(1, 6)) for _ in range(7)]
    prompts[5] = [6, 8]  # a bad word's prefix in the prompt does not count
    outputs[5] = [2]
    params = [
        SamplingParams(temperature=0.0),  # plain greedy beside the others
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.8, presence_penalty=1.5, frequency_penalty=-0.5),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, repetition_penalty=0.6),
        SamplingParams(
            temperature=0.0,
            _bad_words_token_ids=((5, 7, 11), (7, 1), (13,)),
            logit_bias={11: 50.0, 0: -3.0, 13: 100.0},
        ),
        SamplingParams(temperature=0.0, _bad_words_token_ids=((8, 2, 6), (2, 4))),
        SamplingParams(
            temperature=0.0,
            min_tokens=9,
            stop_token_ids=(5, VOCAB + 7),
            _eos_token_ids=(EOS,),
            presence_penalty=0.3,
        ),
    ]
    return params, prompts, outputs


@pytest.mark.parametrize("device_only_last", [False, True], ids=["host", "placeholder"])
def test_processing_equals_vllms_rules_row_by_row(device_only_last: bool) -> None:
    rng = random.Random(7)
    params, prompts, outputs = mixed_batch(rng)
    batch, seq_lens, last = filled_batch(
        params, prompts, outputs, device_only_last=device_only_last
    )
    logits = torch.randn(len(params), VOCAB) * 3
    for rows in (list(range(len(params))), [2, 0, 6, 4], [5]):
        metadata, history = history_of(batch, seq_lens, last, rows)
        processing = metadata.processing
        assert processing is not None
        got = apply_logits_processing(logits[rows], processing, history)
        want = [reference_row(logits[r].tolist(), params[r], prompts[r], outputs[r]) for r in rows]
        assert_rows_close(got, want)
        if rows[0] == 0:
            # Not vacuous: the output's tail, newest token included, matched
            # (5, 7) -> 11 and (2,) -> 4; the prompt's (8, 2) did not ban 6.
            assert math.isinf(got[4, 11]) and math.isinf(got[4, 13])
            assert math.isinf(got[5, 4]) and not math.isinf(got[5, 6])


def test_sampler_processes_greedy_rows_and_keeps_raw_logprobs() -> None:
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2),
        SamplingParams(temperature=0.0, logit_bias={0: 100.0}),
        SamplingParams(temperature=0.0, _bad_words_token_ids=((1,),)),
    ]
    prompts, outputs = [[1], [1], [1], [2]], [[4], [6], [4], [4]]
    batch, seq_lens, last = filled_batch(params, prompts, outputs, device_only_last=True)
    logits = torch.zeros(4, 8)
    logits[:, 1] = 5.0  # the argmax, in the prompts of rows 0-2
    logits[:, 4] = 3.0  # in the outputs
    metadata, history = history_of(batch, seq_lens, last, [0, 1, 2, 3])
    out = Sampler()(logits, metadata, history)
    assert out.sampled_token_ids.tolist() == [1, 4, 0, 4]
    raw = logits.log_softmax(-1)
    assert out.logprobs_tensors is not None
    # Row 1's log-probs are the raw logits' (token 1 stays the most likely there).
    assert torch.allclose(out.logprobs_tensors.logprobs[1, 1:], raw[1].topk(2).values)
    assert out.logprobs_tensors.selected_token_ranks.tolist()[:2] == [1, 2]


def test_random_rows_sample_from_the_processed_logits() -> None:
    params = [
        SamplingParams(temperature=1.0, seed=5, _bad_words_token_ids=((0,), (1,))),
        SamplingParams(temperature=2.0, logit_bias={3: 100.0}),
    ]
    logits = torch.tensor([[9.0, 9.0, -9.0, -9.0]] * 2)
    generator = torch.Generator().manual_seed(5)
    metadata = SamplingMetadata.from_params(params, {0: generator}, CPU)
    for _ in range(20):
        tokens = Sampler()(logits, metadata).sampled_token_ids.tolist()
        assert tokens[0] in (2, 3) and tokens[1] == 3


def test_a_batch_without_processing_takes_the_old_paths() -> None:
    batch, _, _ = filled_batch(
        [SamplingParams(temperature=0.0)] * 2, [[1], [2]], [[3], [4]], device_only_last=False
    )
    assert batch.sampling_metadata([0, 1]) is _ALL_GREEDY
    random_rows = InputBatch(max_num_reqs=4, max_model_len=16, block_size=16, device=CPU)
    random_rows.add_request(
        CachedRequestState("a", [1], SamplingParams(temperature=0.7), None, [], 0)
    )
    assert random_rows.sampling_metadata([0]).processing is None
    # One greedy request with a penalty ends the all-greedy path; its leaving restores it.
    penalized = CachedRequestState(
        "p", [1], SamplingParams(temperature=0.0, repetition_penalty=1.2), None, [], 0
    )
    batch.add_request(penalized)
    metadata = batch.sampling_metadata([0, 1, 2])
    assert metadata is not _ALL_GREEDY and metadata.processing is not None
    assert metadata.processing.history_rows.tolist() == [2]
    batch.remove_request("p", sync_state=False)
    assert batch.sampling_metadata([0, 1]) is _ALL_GREEDY


# ---------------------------------------------------------------------------
# The scheduler and the stop strings wait for min_tokens.


def test_the_scheduler_ignores_stop_ids_before_min_tokens() -> None:
    sched = make_scheduler()
    req = make_request("r", [1, 2, 3], max_tokens=10, eos=(7,), min_tokens=3, stop_token_ids=[8])
    run = drive(sched, FakeRunner(4, scripted([7, 8, 7, 5], 3)), {0: [req]})
    assert run.tokens["r"] == [7, 8, 7]
    assert run.finish["r"] == FinishReason.STOP


def test_stop_strings_count_after_min_tokens(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    ids = tokenizer("a b a b a b", add_special_tokens=False).input_ids
    assert len(ids) == 6

    def stops(min_tokens: int) -> tuple[str | None, str]:
        params = SamplingParams(stop=["b"], min_tokens=min_tokens, max_tokens=8)
        detok = IncrementalDetokenizer(tokenizer, [1], params)
        found = None
        for token in ids:
            found = detok.update([token])
            if found:
                break
        return found, detok.output_text

    assert stops(0) == ("b", "a ")
    assert stops(2) == ("b", "a b a ")  # the first "b" is among the first 2 tokens
    assert stops(6) == (None, "a b a b a b")


# ---------------------------------------------------------------------------
# End to end against HF generate.


class VllmPresenceFrequency:
    """vLLM's presence and frequency penalties (over the output tokens) as
    an HF logits processor."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(
            1, output, torch.ones_like(output, dtype=scores.dtype)
        )
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(
    model: Any, prompt: list[int], params: SamplingParams, eos: list[int] | None
) -> list[int]:
    """HF greedy ``generate`` with the processors that do what ``params`` asks."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Custom(VllmPresenceFrequency, LogitsProcessor):
        pass

    kwargs: dict[str, Any] = {}
    if params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.bad_words_token_ids:
        kwargs["bad_words_ids"] = [list(w) for w in params.bad_words_token_ids]
    if params.logit_bias:
        kwargs["sequence_bias"] = [[[t], b] for t, b in params.logit_bias.items()]
    stop = sorted(set(eos or []) | set(params.stop_token_ids))
    if params.min_tokens:
        kwargs["min_new_tokens"] = params.min_tokens
    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(Custom(len(prompt), params.presence_penalty, params.frequency_penalty))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=params.max_tokens,
            do_sample=False,
            eos_token_id=stop or None,
            pad_token_id=0,
            logits_processor=processors,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


async def serve(engine: asyncstep.Engine, requests: list[tuple[Any, SamplingParams]]) -> list[Any]:
    results: list[Any] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await engine.generate(*requests[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(requests)):
            nursery.start_soon(one, i)
    return results


TINY_PROMPTS = [[3, 17, 92, 5], [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31]]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random Llama (vocabulary 256) with large weights: logits far from ties."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny-penalties")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def tiny_cases(model: Any) -> list[tuple[list[int], SamplingParams]]:
    """The plain requests, one per processor, and all at once; the tokens
    picked from the plain outputs (so that each case changes them)."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    a, b = (hf_generate(model, p, greedy, None) for p in TINY_PROMPTS)
    assert TINY_PROMPTS[1][-1] != b[3]  # the bad word's prefix occurs in the output only

    def params(**kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw)

    return [
        (TINY_PROMPTS[0], greedy),
        (TINY_PROMPTS[1], greedy),
        (TINY_PROMPTS[0], params(repetition_penalty=1.8)),
        (TINY_PROMPTS[1], params(presence_penalty=1.5, frequency_penalty=1.0)),
        (TINY_PROMPTS[0], params(_bad_words_token_ids=((a[2],),))),
        (TINY_PROMPTS[1], params(_bad_words_token_ids=((b[3], b[4]),))),
        (TINY_PROMPTS[1], params(logit_bias={b[1]: -8.0, 77: 4.5})),
        (TINY_PROMPTS[0], params(min_tokens=9, stop_token_ids=[a[3]])),
        (
            TINY_PROMPTS[1],
            params(
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=0.7,
                logit_bias={b[0]: -2.0},
                _bad_words_token_ids=((b[2],), (b[5], b[6])),
                min_tokens=6,
                stop_token_ids=[b[7]],
            ),
        ),
    ]


def assert_each_case_changes_its_plain_output(
    prompts: list[Any], expected: list[list[int]]
) -> None:
    """Cases 0 and 1 are the plain requests of the two prompts."""
    plain = {str(prompts[0]): expected[0], str(prompts[1]): expected[1]}
    for prompt, want in zip(prompts[2:], expected[2:], strict=True):
        assert want != plain[str(prompt)], want


@pytest.fixture(scope="module")
def tiny_expected(tiny_checkpoint: tuple[Path, Any]) -> tuple[list[Any], list[list[int]]]:
    _, model = tiny_checkpoint
    cases = tiny_cases(model)
    expected = [hf_generate(model, prompt, params, None) for prompt, params in cases]
    assert_each_case_changes_its_plain_output([c[0] for c in cases], expected)
    return cases, expected


@pytest.mark.trio
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_tiny_checkpoint_equals_hf_processors(
    tiny_checkpoint: tuple[Path, Any],
    tiny_expected: tuple[list[Any], list[list[int]]],
    overlap: bool,
) -> None:
    path, _ = tiny_checkpoint
    cases, expected = tiny_expected
    async with asyncstep.open_engine(
        path,
        device="cpu",
        dtype="float32",
        async_scheduling=overlap,
        engine_process=overlap,  # the core process too: the new fields cross the wire
        max_num_batched_tokens=8,  # prompts in chunks
    ) as engine:
        got = await serve(engine, cases)
        alone = await engine.generate(*cases[-1])
    assert [c.token_ids for c in got] == expected
    assert alone.token_ids == expected[-1]
    assert len(got[7].token_ids) > 9  # min_tokens=9: its stop id came later


SMOL_QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def smol_prompt(smollm2: LoadedModel, question: str) -> list[int]:
    tok = smollm2.tokenizer
    assert tok is not None
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tok(text, add_special_tokens=False).input_ids)


def vllm_bad_words_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's ``update_from_tokenizer``: each word, and after a space when
    that gives another first token and as many tokens."""
    ids: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        ids.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            ids.append(spaced)
    return ids


#: (question, sampling keywords): the plain requests first. The token ids
#: are SmolLM2's: " capital" 3575, " Paris" 7042, "\n" 198.
SMOL_CASES: list[tuple[int, dict[str, Any]]] = [
    (0, {}),
    (1, {}),
    (1, {"repetition_penalty": 1.3}),
    (1, {"presence_penalty": 1.5, "frequency_penalty": 1.0}),
    (0, {"bad_words": ["Paris"]}),
    (0, {"logit_bias": {3575: -5.0, 7042: 2.0}}),
    (0, {"min_tokens": 12}),
    (
        1,
        {
            "repetition_penalty": 1.2,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.5,
            "bad_words": ["waves", "blue sky"],
            "logit_bias": {198: -2.0},
            "min_tokens": 14,
        },
    ),
]


@pytest.fixture(scope="module")
def smol_expected(smollm2: LoadedModel, hf_smollm2: Any) -> list[list[int]]:
    tokenizer = smollm2.tokenizer
    expected = []
    for question, kwargs in SMOL_CASES:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kwargs)
        if params.bad_words:
            ids = vllm_bad_words_ids(tokenizer, list(params.bad_words))
            params = SamplingParams(
                temperature=0,
                max_tokens=MAX_TOKENS,
                **{k: v for k, v in kwargs.items() if k != "bad_words"},
                _bad_words_token_ids=ids,
            )
        prompt = smol_prompt(smollm2, SMOL_QUESTIONS[question])
        expected.append(hf_generate(hf_smollm2, prompt, params, [2]))
    assert_each_case_changes_its_plain_output([q for q, _ in SMOL_CASES], expected)
    return expected


@pytest.mark.trio
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
async def test_smollm2_equals_hf_processors(
    smollm2: LoadedModel, smol_expected: list[list[int]], overlap: bool
) -> None:
    requests = [
        (
            [{"role": "user", "content": SMOL_QUESTIONS[q]}],
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kwargs),
        )
        for q, kwargs in SMOL_CASES
    ]
    async with asyncstep.open_engine(smollm2, async_scheduling=overlap) as engine:
        got = await serve(engine, requests)
    assert [c.token_ids for c in got] == smol_expected
    assert "Paris" in got[0].text and "Paris" not in got[4].text
    assert len(got[0].token_ids) < 12 <= len(got[6].token_ids)  # EOS waited for min_tokens


def test_bad_words_tokenize_like_vllm(smollm2: LoadedModel) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    words = ["Paris", "  hello world", "Red"]

    async def tokenized() -> Any:
        async with asyncstep.open_engine(smollm2) as engine:
            return engine.input_processor.check_params(
                SamplingParams(bad_words=words)
            ).bad_words_token_ids

    got = trio.run(tokenized)
    assert [list(t) for t in got] == vllm_bad_words_ids(tokenizer, words)
    assert len(got) > len(words)  # with the spaced forms


def test_cli_penalty_flags() -> None:
    from asyncstep.cli import build_parser, sampling_params

    args = build_parser().parse_args(
        [
            "generate",
            "--presence-penalty",
            "0.5",
            "--frequency-penalty=-1",
            "--repetition-penalty",
            "1.3",
            "hi",
        ]
    )
    params = sampling_params(args)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.3
    plain = sampling_params(build_parser().parse_args(["generate", "hi"]))
    assert not plain.processes_logits
