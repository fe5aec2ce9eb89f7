"""Tests of asyncstep.runner.sampler: greedy, temperature, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pytest
import torch

from asyncstep.datatypes import Logprobs, SamplingParams
from asyncstep.runner.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
)

CPU = torch.device("cpu")
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _seeded_default_rng() -> Iterator[None]:
    """Unseeded rows draw from the default RNG: seed it, and restore it afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        yield


def metadata(
    params: Sequence[SamplingParams], generators: dict[int, torch.Generator] | None = None
) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, generators or {}, CPU)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: dict[int, torch.Generator] | None = None,
) -> torch.Tensor:
    return Sampler()(logits, metadata(params, generators)).sampled_token_ids


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def log_probs(probs: Sequence[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()


# --------------------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 100)
    out = Sampler()(logits, metadata([SamplingParams(temperature=0.0)] * 8))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.shape == (8,)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs_tensors is None


def test_greedy_ties_take_lowest_index() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)]).tolist() == [1]


def test_greedy_rows_exact_in_mixed_batch() -> None:
    logits = torch.randn(16, 50)
    params = [
        SamplingParams(temperature=0.0)
        if i % 2 == 0
        else SamplingParams(temperature=5.0, top_k=10, top_p=0.9, min_p=0.01)
        for i in range(16)
    ]
    meta = metadata(params, {1: gen(1), 2: gen(2)})
    assert not meta.all_greedy and not meta.all_random
    for _ in range(5):
        tokens = Sampler()(logits, meta).sampled_token_ids
        assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 32).to(dtype)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=3, logprobs=2)] * 2
    out = Sampler()(logits, metadata(params))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids[0::2], logits[0::2].float().argmax(dim=-1))
    assert out.logprobs_tensors is not None
    assert out.logprobs_tensors.logprobs.dtype == torch.float32


def test_empty_batch() -> None:
    assert sample(torch.empty(0, 10), []).shape == (0,)


# --------------------------------------------------------------------------- temperature


def test_very_low_temperature_is_greedy() -> None:
    logits = torch.randn(64, 200)
    tokens = sample(logits, [SamplingParams(temperature=1e-3)] * 64)
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_over_temperature(temperature: float) -> None:
    base = torch.tensor([1.0, 2.0, 0.5, 0.0, -1.0])
    n = 20_000
    tokens = sample(base.expand(n, -1), [SamplingParams(temperature=temperature)] * n)
    expected = (base / temperature).softmax(dim=-1)
    assert torch.allclose(frequencies(tokens, 5), expected, atol=0.015)


def test_higher_temperature_flattens() -> None:
    base = torch.tensor([2.0, 0.0, 0.0, 0.0])
    n = 10_000
    cold = frequencies(sample(base.expand(n, -1), [SamplingParams(temperature=0.5)] * n), 4)
    hot = frequencies(sample(base.expand(n, -1), [SamplingParams(temperature=4.0)] * n), 4)
    assert cold[0] > 0.9 > 0.5 > hot[0]


# --------------------------------------------------------------------------- top-k


def test_top_k_never_samples_outside_k_largest() -> None:
    n, vocab = 400, 64
    logits = torch.randn(n, vocab) * 0.1  # nearly flat: every kept token gets drawn
    ks = [1 + i % 8 for i in range(n)]
    params = [SamplingParams(temperature=3.0, top_k=k) for k in ks]
    tokens = sample(logits, params)
    for row, (token, k) in enumerate(zip(tokens.tolist(), ks, strict=True)):
        assert token in logits[row].topk(k).indices.tolist()


def test_top_k_draws_all_of_the_k() -> None:
    n = 5000
    logits = torch.tensor([0.0, 3.0, 0.1, 2.9, 2.8, -1.0]).expand(n, -1)
    tokens = sample(logits, [SamplingParams(top_k=3)] * n)
    assert set(tokens.tolist()) == {1, 3, 4}


def test_top_k_off_values_and_large_k() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    out = apply_top_k_top_p(logits, torch.tensor([0, -1, 10]), None)
    assert torch.equal(out, logits)


def test_top_k_mask() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0], [3.0, 2.0, 1.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 1]), None)
    expected = torch.tensor([[NEG_INF, 5.0, NEG_INF, 4.0], [3.0, NEG_INF, NEG_INF, NEG_INF]])
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------- top-p


def test_top_p_mask_known_probabilities() -> None:
    # Probabilities 0.1, 0.4, 0.2, 0.3 (the top one at index 1).
    logits = log_probs([0.1, 0.4, 0.2, 0.3]).expand(4, -1)
    top_p = torch.tensor([0.35, 0.65, 0.85, 1.0])
    kept = apply_top_k_top_p(logits, None, top_p).isfinite()
    assert kept.tolist() == [
        [False, True, False, False],  # 0.4 >= 0.35: the top token alone
        [False, True, False, True],  # 0.4 + 0.3 >= 0.65
        [False, True, True, True],  # 0.4 + 0.3 + 0.2 >= 0.85
        [True, True, True, True],  # off
    ]


def test_top_p_never_samples_outside_nucleus() -> None:
    n = 20_000
    logits = log_probs([0.1, 0.4, 0.2, 0.3]).expand(n, -1)
    tokens = sample(logits, [SamplingParams(top_p=0.65)] * n)
    freq = frequencies(tokens, 4)
    assert freq[0] == 0 and freq[2] == 0
    assert torch.allclose(freq[[1, 3]], torch.tensor([4 / 7, 3 / 7]), atol=0.015)


def test_top_p_always_keeps_top_token() -> None:
    n = 1000
    logits = log_probs([0.3, 0.25, 0.25, 0.2]).expand(n, -1)
    tokens = sample(logits, [SamplingParams(top_p=1e-6)] * n)
    assert set(tokens.tolist()) == {0}


def test_top_p_applies_after_top_k() -> None:
    # After top-k=3 the probabilities are 4/9, 3/9, 2/9: p = 0.75 keeps two tokens.
    # Without top-k, p = 0.75 would keep three (0.4 + 0.3 < 0.75).
    logits = log_probs([0.4, 0.3, 0.2, 0.1]).expand(2, -1)
    kept = apply_top_k_top_p(logits, torch.tensor([3, 0]), torch.tensor([0.75, 0.75])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True, True, True, False]]


# --------------------------------------------------------------------------- min-p


def test_min_p_mask() -> None:
    logits = log_probs([0.5, 0.3, 0.15, 0.05]).expand(3, -1).clone()
    kept = apply_min_p(logits, torch.tensor([0.0, 0.2, 0.5])).isfinite()
    assert kept.tolist() == [
        [True, True, True, True],
        [True, True, True, False],  # 0.05 < 0.2 * 0.5
        [True, True, False, False],  # 0.15 < 0.5 * 0.5
    ]


def test_min_p_sampling() -> None:
    n = 20_000
    logits = log_probs([0.5, 0.3, 0.15, 0.05]).expand(n, -1)
    freq = frequencies(sample(logits, [SamplingParams(min_p=0.2)] * n), 4)
    assert freq[3] == 0
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.015)


# --------------------------------------------------------------------------- seeds


def _seeded_run(
    seed: int, position: int, batch_size: int, steps: int, logits: torch.Tensor
) -> list[int]:
    """Tokens of the request seeded ``seed`` at ``position`` over ``steps`` steps."""
    generator = gen(seed)
    others = {i: gen(1000 + i) for i in range(batch_size) if i % 2 == 1 and i != position}
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 2 else SamplingParams(temperature=1.0)
        for i in range(batch_size)
    ]
    params[position] = SamplingParams(temperature=1.0, seed=seed)
    tokens = []
    for _ in range(steps):
        meta = metadata(params, {**others, position: generator})
        out = Sampler()(logits.expand(batch_size, -1), meta)
        tokens.append(int(out.sampled_token_ids[position]))
    return tokens


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    logits = torch.zeros(1000)  # uniform: any difference in the draws shows
    alone = _seeded_run(7, position=0, batch_size=1, steps=20, logits=logits)
    assert alone == _seeded_run(7, position=0, batch_size=1, steps=20, logits=logits)
    assert alone == _seeded_run(7, position=3, batch_size=6, steps=20, logits=logits)
    assert alone == _seeded_run(7, position=5, batch_size=6, steps=20, logits=logits)
    assert len(set(alone)) > 10


def test_same_seed_same_tokens_with_filters() -> None:
    logits = torch.randn(500)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=3)

    def run(position: int, batch_size: int) -> list[int]:
        generator = gen(3)
        batch = [SamplingParams(top_k=5)] * batch_size
        batch[position] = params
        meta = metadata(batch, {position: generator})
        return [
            int(Sampler()(logits.expand(batch_size, -1), meta).sampled_token_ids[position])
            for _ in range(10)
        ]

    assert run(0, 1) == run(2, 4)


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1000)
    assert _seeded_run(1, 0, 1, 10, logits) != _seeded_run(2, 0, 1, 10, logits)


def test_generator_advanced_once_per_call() -> None:
    vocab = 300
    seeded, reference = gen(11), gen(11)
    params = [SamplingParams(), SamplingParams(seed=11), SamplingParams(temperature=0.0)]
    meta = metadata(params, {1: seeded})
    for _ in range(3):
        Sampler()(torch.randn(3, vocab), meta)
        torch.empty(vocab).exponential_(generator=reference)
        assert torch.equal(seeded.get_state(), reference.get_state())


def test_greedy_rows_generators_untouched() -> None:
    generator = gen(5)
    before = generator.get_state()
    params = [SamplingParams(temperature=0.0, seed=5), SamplingParams()]
    Sampler()(torch.randn(2, 100), metadata(params, {0: generator}))
    assert torch.equal(generator.get_state(), before)


# --------------------------------------------------------------------------- logprobs


def test_logprobs_of_raw_logits() -> None:
    logits = torch.randn(6, 40)
    params = [SamplingParams(temperature=0.5, top_k=5, logprobs=3)] * 3 + [
        SamplingParams(temperature=0.0, logprobs=1)
    ] * 3
    out = Sampler()(logits, metadata(params))
    lt = out.logprobs_tensors
    assert lt is not None
    assert lt.logprob_token_ids.shape == (6, 4) and lt.logprobs.shape == (6, 4)
    assert lt.logprob_token_ids.dtype == torch.int64

    expected = logits.log_softmax(dim=-1)  # raw: no temperature, no top-k
    sampled = out.sampled_token_ids
    assert torch.equal(lt.logprob_token_ids[:, 0], sampled)
    assert torch.allclose(lt.logprobs, expected.gather(-1, lt.logprob_token_ids))
    top = expected.topk(3, dim=-1)
    assert torch.equal(lt.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(lt.logprobs[:, 1:], top.values)

    ranks = (expected > expected.gather(-1, sampled.unsqueeze(-1))).sum(-1) + 1
    assert torch.equal(lt.selected_token_ranks, ranks)
    assert lt.selected_token_ranks[3:].tolist() == [1, 1, 1]  # greedy rows


def test_logprobs_known_values() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 3.0]])
    out = Sampler()(logits, metadata([SamplingParams(temperature=0.0, logprobs=2)]))
    lt = out.logprobs_tensors
    assert lt is not None
    assert lt.logprob_token_ids.tolist() == [[1, 1, 3]]
    assert lt.selected_token_ranks.tolist() == [1]
    expected = logits.log_softmax(dim=-1)[0, [1, 1, 3]]
    assert torch.allclose(lt.logprobs[0], expected)


def test_logprobs_k_zero_and_tolists() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 0.0, 3.0]])
    out = Sampler()(logits, metadata([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    lt = out.logprobs_tensors
    assert lt is not None
    assert lt.logprob_token_ids.shape == (2, 1)
    rows = lt.tolists()
    expected = logits.log_softmax(dim=-1)
    assert rows[0].token_ids == [1] and rows[1].token_ids == [2]
    assert isinstance(rows[0], Logprobs) and rows[0].sampled_token_rank == 1
    assert math.isclose(rows[0].logprobs[0], float(expected[0, 1]), rel_tol=1e-6)


def test_logprobs_rank_below_top() -> None:
    # top_p keeps tokens 0 and 1, sampled many times: the second one has rank 2.
    n = 200
    logits = log_probs([0.5, 0.45, 0.05]).expand(n, -1)
    out = Sampler()(logits, metadata([SamplingParams(top_p=0.9, logprobs=1)] * n))
    lt = out.logprobs_tensors
    assert lt is not None
    sampled = out.sampled_token_ids
    assert set(sampled.tolist()) == {0, 1}
    assert torch.equal(lt.selected_token_ranks, sampled + 1)
    assert (lt.logprob_token_ids[:, 1] == 0).all()


# --------------------------------------------------------------------------- metadata, input


def test_from_params_defaults_leave_filters_none() -> None:
    meta = metadata([SamplingParams(), SamplingParams(temperature=0.7)])
    assert meta.all_random and not meta.all_greedy
    assert meta.temperature is not None
    assert meta.temperature.dtype == torch.float32
    assert torch.allclose(meta.temperature, torch.tensor([1.0, 0.7]))
    assert meta.top_p is None and meta.top_k is None and meta.min_p is None
    assert meta.max_num_logprobs is None and meta.generators == {}


def test_from_params_all_greedy() -> None:
    meta = metadata([SamplingParams(temperature=0.0, top_k=5, top_p=0.5, logprobs=2)] * 2)
    assert meta.all_greedy and not meta.all_random
    assert meta.temperature is None
    # Filters of greedy rows do not count.
    assert meta.top_p is None and meta.top_k is None and meta.min_p is None
    assert meta.max_num_logprobs == 2


def test_from_params_mixed() -> None:
    params = [
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(top_k=4, logprobs=3, seed=2),
        SamplingParams(top_p=0.5, min_p=0.1, logprobs=0),
    ]
    g0, g1 = gen(1), gen(2)
    meta = metadata(params, {0: g0, 1: g1})
    assert not meta.all_greedy and not meta.all_random
    assert meta.top_k is not None and meta.top_k.dtype == torch.int64
    assert meta.top_k.tolist() == [0, 4, 0]
    assert meta.top_p is not None and meta.top_p.tolist() == [1.0, 1.0, 0.5]
    assert meta.min_p is not None and meta.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert meta.max_num_logprobs == 3
    assert meta.generators == {1: g1}  # the greedy row's generator is left out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_logits_not_modified(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 64).to(dtype)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=8, top_p=0.8, min_p=0.05, logprobs=2, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, min_p=0.2),
        SamplingParams(top_p=0.3),
    ]
    Sampler()(logits, metadata(params, {0: gen(1)}))
    assert torch.equal(logits, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mixed_batch() -> None:
    cuda = torch.device("cuda")
    logits = torch.randn(4, 1000, device=cuda, dtype=torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_k=20, top_p=0.9, min_p=0.01, seed=3),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
    ]

    def run() -> torch.Tensor:
        generators = {1: torch.Generator(device=cuda).manual_seed(3)}
        meta = SamplingMetadata.from_params(params, generators, cuda)
        out = Sampler()(logits, meta)
        assert out.sampled_token_ids.device.type == "cuda"
        return out.sampled_token_ids

    first, second = run(), run()
    greedy = logits.float().argmax(dim=-1)
    assert torch.equal(first[[0, 3]], greedy[[0, 3]])
    assert first[1] == second[1]


@pytest.mark.parametrize("vocab", [128256, 1000, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_argmax_is_argmax_with_the_lowest_id_on_ties(
    vocab: int, dtype: torch.dtype
) -> None:
    """The two-stage argmax of the CUDA greedy path gives ``argmax``'s ids,
    the lowest on ties (inside a chunk and across chunks), with a padded
    last chunk, -inf and +inf logits, one row and several (on the test
    device: CUDA's reductions there)."""
    from asyncstep.runner.sampler import argmax_rows, chunked_argmax
    from tests.conftest import TEST_DEVICE

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype).to(TEST_DEVICE)
    top = float(logits.float().max()) + 1
    logits[1, [5, 300, vocab - 1]] = top  # ties across chunks: 5 wins
    logits[2, [vocab - 2, vocab - 1]] = top  # a tie in the (padded) last chunk
    logits[3] = float("-inf")  # every logit -inf: index 0, as argmax
    logits[4, [7, 700]] = float("inf")
    logits[5, :] = top  # all tied: 0
    expected = logits.argmax(dim=-1)
    assert expected[1] == 5 and expected[3] == 0 and expected[5] == 0
    for chunk in (256, 100, 7):
        assert torch.equal(chunked_argmax(logits, chunk), expected)
        assert torch.equal(chunked_argmax(logits[:1], chunk), expected[:1])
    assert torch.equal(argmax_rows(logits), expected)


def test_the_cpu_argmax_is_torch_s() -> None:
    """float32 rows on the CPU (numpy's argmax, one thread): torch's ids,
    the lowest on ties, the first NaN, 0 for a row of -inf; no rows, one
    row, a strided view."""
    from asyncstep.runner.sampler import argmax_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49152, generator=gen)
    logits[0, [9, 400]] = 10.0  # a tie: 9
    logits[1, [3, 800]] = float("nan")  # the first NaN: 3
    logits[2] = float("-inf")
    logits[3, 100] = float("inf")
    for rows in (logits, logits[:0], logits[1:2], logits[:, ::2]):
        got = argmax_rows(rows)
        assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1))
    assert argmax_rows(logits)[:4].tolist() == [9, 3, 0, 100]
