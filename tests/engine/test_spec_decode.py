"""Speculative decoding's parts: the ``speculative_config`` option (checked
at the door, and on the command line), the n-gram proposer, the rejection
sampler (greedy exactness; the sampled rule's output distribution equals
the target's, a statistical test with a fixed seed and stated tolerances)
and the speculative step's metadata."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from asyncstep.cli import build_parser, config_from_args
from asyncstep.config import EngineConfig, SpeculativeConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.spec_decode.ngram_proposer import NgramProposer, propose_ngram
from asyncstep.errors import ConfigError
from asyncstep.runner.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    RejectionSampler,
    rejection_sample,
    target_probs,
)
from asyncstep.runner.sampler import SamplingMetadata
from asyncstep.runner.spec_decode_metadata import build_spec_decode_metadata

CPU = torch.device("cpu")

# -- the option ------------------------------------------------------------------


def test_speculative_config_with_vllms_names() -> None:
    config = EngineConfig.from_options(
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    )
    spec = config.speculative_config
    assert spec == SpeculativeConfig(
        method="ngram", num_speculative_tokens=4, prompt_lookup_min=4, prompt_lookup_max=4
    )
    # With overlap: a verify step is its request's only step in flight (see the scheduler).
    assert config.uses_output_placeholders and config.batch_queue_size == 2
    default = EngineConfig.from_options(speculative_config={})
    assert default.speculative_config is not None
    assert default.speculative_config.prompt_lookup_min == 5
    assert EngineConfig().speculative_config is None
    assert EngineConfig().uses_output_placeholders


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in"),
        ({"num_speculative_tokens": 99}, "num_speculative_tokens must be in"),
        (
            {"prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min <= prompt_lookup_max"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
        ({"num_speculative_token": 4}, "unknown field"),
        ({"num_speculative_tokens": "4"}, "Expected `int`"),
        (4, "Expected `object | null`"),
    ],
)
def test_a_bad_speculative_config_is_one_line_at_the_door(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        EngineConfig.from_options(speculative_config=value)
    assert "\n" not in str(info.value)


def test_speculation_with_a_pipeline_is_refused() -> None:
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        EngineConfig.from_options(speculative_config={}, pipeline_parallel_size=2)


def test_the_command_line_takes_json() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["generate", "--speculative-config", '{"num_speculative_tokens": 3}', "hi"]
    )
    spec = config_from_args(args).speculative_config
    assert spec is not None and spec.num_speculative_tokens == 3
    assert config_from_args(parser.parse_args(["generate", "hi"])).speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--speculative-config", "{not json", "hi"])


# -- the n-gram proposer ----------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "expected"),
    [
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 4, [4, 5, 9, 1]),  # the 3-gram 1 2 3
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 4, 5, 4, []),  # no 4-gram recurs
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 1, 3, 2, [4, 5]),  # k caps
        ([5, 1, 2, 8, 1, 2, 9, 1, 2], 1, 3, 2, [9, 1]),  # the latest occurrence
        ([1, 2, 3, 1, 2, 3, 1, 2], 1, 3, 3, [3, 1, 2]),  # latest with k tokens after it
        ([1, 2, 1, 3, 1], 1, 2, 2, [3, 1]),  # n = 1
        ([1, 2, 1, 3, 7, 3], 2, 2, 2, []),  # min_n = 2: "1 3"... "7 3" never recurs
        ([4, 4], 1, 1, 3, [4]),  # up to the end of the sequence
        ([4], 1, 1, 3, []),  # too short
        ([1, 2, 3], 1, 3, 3, []),  # nothing recurs
    ],
)
def test_propose_ngram(
    tokens: list[int], min_n: int, max_n: int, k: int, expected: list[int]
) -> None:
    drafts = propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k)
    assert drafts.tolist() == expected


def test_the_longest_ngram_wins_over_a_later_shorter_one() -> None:
    # "2 3" occurs at 1-2 (followed by 7) and "3" alone at 5 (followed by 8).
    tokens = np.array([1, 2, 3, 7, 0, 3, 8, 5, 2, 3])
    assert propose_ngram(tokens, 1, 2, 1).tolist() == [7]
    assert propose_ngram(tokens, 1, 1, 1).tolist() == [8]


def test_the_proposer_caps_its_drafts() -> None:
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    )
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose("r", tokens, 10) == [3, 4, 5]
    assert proposer.propose("r", tokens, 1) == [3]
    assert proposer.propose("r", tokens, 0) == []


def test_the_proposer_keeps_each_requests_tokens_as_they_grow() -> None:
    proposer = NgramProposer(
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
    )
    tokens = [7, 8, 9, 1]
    assert proposer.propose("r", tokens, 10) == []
    for token, expected in [(7, [8, 9]), (8, [9, 1]), (5, []), (9, [1, 7])]:
        tokens.append(token)
        assert proposer.propose("r", tokens, 10) == expected
        assert proposer.propose("r", tokens, 10) == expected  # asked again: the same
    tokens += [*range(100, 300), 100]  # the buffer grows
    assert proposer.propose("r", tokens, 10) == [101, 102]
    # An id used again with other tokens: started over (forget() is the rule).
    assert proposer.propose("r", [3, 1, 2, 3], 10) == [1, 2]
    proposer.forget("r")
    assert proposer.propose("r", [4, 4], 10) == [4]


# -- the rejection sampler ---------------------------------------------------------


def metadata_of(params: list[SamplingParams], generators: dict[int, torch.Generator] | None = None):  # type: ignore[no-untyped-def]
    return SamplingMetadata.from_params(params, generators or {}, CPU)


GREEDY = SamplingParams(temperature=0)


def test_rejection_sample_lays_out_accepted_prefix_then_one_token() -> None:
    out = rejection_sample(
        draft_token_ids=torch.tensor([10, 11, 12, 20, 30, 31]),
        num_draft_tokens=[3, 1, 0, 2],
        accepted=torch.tensor([True, False, True, True, True, True]),
        recovered_token_ids=torch.tensor([100, 101, 102, 200, 300, 301]),
        bonus_token_ids=torch.tensor([1000, 2000, 3000, 4000]),
    )
    p = PLACEHOLDER_TOKEN_ID
    assert out.tolist() == [
        [10, 101, p, p],  # the second draft rejected: its recovered token
        [20, 2000, p, p],  # all accepted: the bonus
        [3000, p, p, p],  # no drafts: the bonus alone
        [30, 31, 4000, p],
    ]


def test_greedy_verification_is_exact() -> None:
    vocab = 16
    logits = torch.randn(7, vocab)
    argmax = logits.argmax(dim=-1)
    # Row 0: 3 drafts, the first two right; row 1: 2 drafts, both right; row 2: 2 wrong.
    drafts = torch.tensor(
        [
            argmax[0],
            argmax[1],
            (argmax[2] + 1) % vocab,
            argmax[3],
            argmax[4],
            (argmax[5] + 1) % vocab,
            argmax[6],
        ]
    )
    bonus = torch.tensor([7, 8, 9])
    out = RejectionSampler()(drafts, [3, 2, 2], logits, bonus, metadata_of([GREEDY] * 7))
    p = PLACEHOLDER_TOKEN_ID
    assert out.tolist() == [
        [int(argmax[0]), int(argmax[1]), int(argmax[2]), p],
        [int(argmax[3]), int(argmax[4]), 8, p],
        [int(argmax[5]), p, p, p],
    ]


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
    ],
    ids=["plain", "top_k", "top_p_min_p"],
)
@pytest.mark.parametrize("draft", [0, 3, 5])  # the likeliest, a middling and an unlikely draft
def test_the_sampled_rule_keeps_the_target_distribution(params: SamplingParams, draft: int) -> None:
    """Every row: two drafts (``draft`` then token 1) at positions whose
    target is ``p``; the bonus is sampled from ``p``. The first output token,
    and the second among rows that accepted the first draft, must be
    distributed as ``p``. Tolerance: 0.012 absolute per token (N = 60,000
    rows; a frequency's standard deviation is at most 0.002, and 0.0045 for
    the second token's smallest conditioning set, p(draft) >= 0.05 of them:
    the bound is over 5 sigma for the first token, and the second token is
    checked only where at least 8,000 rows condition it)."""
    torch.manual_seed(1234)
    vocab, rows = 6, 60_000
    base = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.2, -0.5])
    p = target_probs(base.unsqueeze(0), metadata_of([params])).squeeze(0)
    # A draft the filters leave out (p = 0) is always rejected: the first
    # token is then p's all the same.
    logits = base.repeat(2 * rows, 1)
    drafts = torch.tensor([draft, 1]).repeat(rows)
    bonus = torch.multinomial(p, rows, replacement=True)
    out = RejectionSampler()(drafts, [2] * rows, logits, bonus, metadata_of([params] * 2 * rows))
    first = out[:, 0]
    assert (first >= 0).all()
    assert torch.allclose(empirical(first, vocab), p.double(), atol=0.012)
    accepted_first = out[first == draft]
    if len(accepted_first) >= 8_000:
        second = accepted_first[:, 1]
        assert (second >= 0).all()
        assert torch.allclose(empirical(second, vocab), p.double(), atol=0.012)


def test_a_seeded_row_verifies_the_same_way_twice() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(4, 32)
    drafts = torch.tensor([3, 4, 5, 6])
    bonus = torch.tensor([9])

    def run() -> list[list[int]]:
        generator = torch.Generator().manual_seed(7)
        metadata = metadata_of([params] * 4, dict.fromkeys(range(4), generator))
        return RejectionSampler()(drafts, [4], logits, bonus, metadata).tolist()

    assert run() == run()


def test_greedy_and_random_rows_in_one_batch() -> None:
    vocab = 8
    logits = torch.full((2, vocab), -10.0)
    logits[0, 3] = 10.0  # greedy row's target: 3
    logits[1, 5] = 30.0  # random row's target: 5 with probability ~1
    metadata = metadata_of([GREEDY, SamplingParams(temperature=1.0)])
    out = RejectionSampler()(torch.tensor([3, 2]), [1, 1], logits, torch.tensor([6, 7]), metadata)
    assert out.tolist() == [[3, 6], [5, PLACEHOLDER_TOKEN_ID]]


# -- the step's metadata -------------------------------------------------------------


def test_spec_decode_metadata_points_at_draft_and_bonus_positions() -> None:
    # Three sampling rows: 2 drafts (query of 3 tokens), none (a decode), 1 draft.
    cu_num_tokens = np.array([3, 4, 6])
    indices, meta = build_spec_decode_metadata([[7, 8], [], [9]], cu_num_tokens, CPU)
    assert indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert meta.draft_token_ids.tolist() == [7, 8, 9]
    assert meta.num_draft_tokens == [2, 0, 1]
    assert meta.target_logits_indices.tolist() == [0, 1, 4]
    assert meta.bonus_logits_indices.tolist() == [2, 3, 5]
    assert meta.last_token_indices.tolist() == [2, 3, 5]
    # A prompt chunk that does not sample sits between: its tokens are skipped.
    indices, meta = build_spec_decode_metadata([[7], [1, 2]], np.array([2, 10]), CPU)
    assert indices.tolist() == [0, 1, 7, 8, 9]
    assert meta.target_logits_indices.tolist() == [0, 2, 3]
    assert meta.bonus_logits_indices.tolist() == [1, 4]


# -- the front end: several tokens a step ---------------------------------------------


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_steps_tokens_cuts_the_tokens_after_it(include: bool) -> None:
    """A step's accepted tokens may run past a stop string: the tokens
    after the one that completed it reach no client."""
    from asyncstep.engine.front_end.request_state import RequestState
    from asyncstep.errors import ModelLoadError
    from asyncstep.models.loader import open_checkpoint

    try:
        tokenizer = open_checkpoint(None).load_tokenizer()
    except ModelLoadError as exc:  # the GPU machine has no embedded model; CPU runs must
        if os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu") == "cpu":
            raise
        pytest.skip(f"needs SmolLM2's tokenizer: {exc}")
    ids = tokenizer(" one two three four five six").input_ids
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    stop_at = next(i for i, text in enumerate(pieces) if "hre" in text)  # the token completing it
    params = SamplingParams(
        temperature=0, max_tokens=50, stop=("hre",), include_stop_str_in_output=include
    )
    state = RequestState("r", None, [1, 2], params, tokenizer)
    assert state.add_output(ids[:1], None, None, None) is None
    assert state.add_output(ids[1:], None, None, None) == "hre"
    assert state.finish_reason == "stop" and state.stop_reason == "hre"
    assert state.token_ids == ids[: stop_at + 1]
    assert state.output().text == (" one two thre" if include else " one two t")


# -- the metrics ------------------------------------------------------------------------


def test_metrics_show_the_spec_decode_counters_when_speculation_is_on() -> None:
    from asyncstep.engine.front_end.statistics import EngineStatistics
    from asyncstep.server.metrics import _EngineCollector

    class FakeEngine:
        def __init__(self, stats: EngineStatistics) -> None:
            self.stats = stats

        def statistics(self) -> EngineStatistics:
            return self.stats

    base = dict(
        num_running_reqs=0,
        num_waiting_reqs=0,
        num_steps=5,
        num_preemptions=0,
        num_generated_tokens=9,
        num_finished_reqs=1,
        kv_cache_usage=0.0,
        num_kv_blocks=8,
        prefix_cache_hit_rate=0.0,
    )
    on = EngineStatistics(
        **base,  # type: ignore[arg-type]
        spec_decode_num_drafts=3,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=5,
        spec_decode_num_accepted_tokens_per_pos=(3, 1, 1, 0),
    )
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in _EngineCollector(FakeEngine(on), "m").collect()  # type: ignore[arg-type]
        for s in family.samples
    }
    assert samples[("asyncstep:spec_decode_num_draft_tokens_total", None)] == 12
    assert samples[("asyncstep:spec_decode_num_accepted_tokens_total", None)] == 5
    assert samples[("asyncstep:spec_decode_num_drafts_total", None)] == 3
    assert samples[("asyncstep:spec_decode_num_accepted_tokens_per_pos_total", "1")] == 1
    off = EngineStatistics(**base)  # type: ignore[arg-type]
    names = {f.name for f in _EngineCollector(FakeEngine(off), "m").collect()}  # type: ignore[arg-type]
    assert not any("spec_decode" in name for name in names)


def test_the_host_greedy_path_lays_out_as_the_device_path() -> None:
    from asyncstep.runner.rejection_sampler import _greedy_on_host

    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        counts = torch.randint(0, 5, (4,), generator=generator).tolist()
        total = sum(counts)
        drafts = torch.randint(0, 3, (total,), generator=generator)
        argmax = torch.randint(0, 3, (total,), generator=generator)
        bonus = torch.randint(10, 20, (4,), generator=generator)
        device_path = rejection_sample(drafts, counts, argmax == drafts, argmax, bonus)
        assert torch.equal(_greedy_on_host(drafts, counts, argmax, bonus), device_path)
