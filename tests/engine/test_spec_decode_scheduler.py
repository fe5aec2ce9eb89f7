"""Speculative decoding in the scheduler, driven by a fake runner that
verifies drafts exactly as a greedy target model would.

The fake runner (``tests/engine/test_scheduler.py``'s, extended) writes every
scheduled token, drafts included, to a fake paged KV cache and checks that
every step reads back the request's tokens at every earlier position: a
rejected draft's slot left as if computed, a wrong rollback of
``num_computed_tokens`` or a wrong prefix-cache hit fails. The target
"model" is a token function of the whole sequence that often repeats the
sequence (so the n-gram drafts are often right, sometimes not); outputs
must equal the request run alone without speculation, token for token,
with ``max_tokens``, stop tokens, EOS, preemption, prefix caching, chunked
prefill and aborts.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import deque
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import (
    EOS,
    VOCAB,
    FakeRunner,
    Run,
    TokenFn,
    _RunnerReq,
    assert_all_blocks_free,
    cdiv,
    check_step,
    make_request,
    prompt_of,
    reference,
)

from asyncstep.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from asyncstep.datatypes import FinishReason, ModelRunnerOutput, SchedulerOutput
from asyncstep.engine.core.request import Request, RequestStatus
from asyncstep.engine.core.scheduler import Scheduler
from asyncstep.errors import InvalidRequestError

PERIOD = 5


def repeating_token(tokens: Sequence[int]) -> int:
    """Mostly the token ``PERIOD`` back (n-gram drafts then hit), every
    third sequence (by hash) a fresh one (drafts then miss)."""
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    if h % 3 and len(tokens) >= PERIOD:
        return tokens[-PERIOD]
    return h % VOCAB


class SpecFakeRunner(FakeRunner):
    """:class:`FakeRunner` that verifies draft tokens: it computes the
    request's tokens and its drafts, accepts drafts while each is the token
    the target would sample there, and returns the accepted drafts and the
    target's next token."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size, repeating_token)
        self.num_draft_tokens = 0
        self.num_accepted = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._drafts = out.scheduled_spec_decode_tokens
        for req_id, drafts in self._drafts.items():
            assert out.num_scheduled_tokens[req_id] == 1 + len(drafts)
        return super().execute(out)

    def _run_request(
        self, state: _RunnerReq, num_tokens: int, written: set[tuple[int, int]]
    ) -> list[int]:
        req_id = next(r for r, s in self.states.items() if s is state)
        drafts = self._drafts.get(req_id, [])
        bs = self.block_size
        start, end = state.num_computed, state.num_computed + num_tokens
        assert not drafts or start == len(state.tokens) - 1, "drafts follow the last token"
        assert end <= len(state.tokens) + len(drafts)
        # Blocks of a rejected draft may stay the request's.
        assert len(state.block_ids) >= cdiv(end, bs)
        sequence = state.tokens + list(drafts)
        for pos in range(start, end):
            slot = (state.block_ids[pos // bs], pos % bs)
            assert slot not in written, "two requests write one slot in a step"
            written.add(slot)
            self.kv[slot] = (sequence[pos], pos)
        for pos in range(end):  # "attention" reads every earlier position
            slot = (state.block_ids[pos // bs], pos % bs)
            assert self.kv.get(slot) == (sequence[pos], pos), f"bad KV at {pos}"
        if end < len(state.tokens):
            state.num_computed = end
            return []  # a prompt chunk that is not the last
        sampled: list[int] = []
        for draft in [*drafts, None]:
            token = self.token_fn(state.tokens)
            state.tokens.append(token)
            sampled.append(token)
            if token != draft:
                break
        self.num_draft_tokens += len(drafts)
        self.num_accepted += len(sampled) - 1
        # The rejected drafts are not computed (nor the last token sampled).
        state.num_computed = end - len(drafts) + len(sampled) - 1
        return sampled


def make_spec_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    prefix_caching: bool = True,
    k: int = 4,
    async_scheduling: bool = False,
    disable_by_batch_size: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
        speculative_config=SpeculativeConfig(
            num_speculative_tokens=k,
            prompt_lookup_min=1,
            prompt_lookup_max=3,
            disable_by_batch_size=disable_by_batch_size,
        ),
    )


def check_spec_kv(sched: Scheduler) -> None:
    """Every reference is held by a live request; a running request holds
    the blocks of its computed tokens, maybe more (a rejected draft's)."""
    kv = sched.kv_cache_manager
    holders = [0] * kv.num_blocks
    for request in [*sched.requests.values(), *sched._finishing.values()]:
        ids = kv.get_block_ids(request.request_id)
        if request.status == RequestStatus.RUNNING:
            assert len(ids) >= cdiv(request.num_computed_tokens, kv.block_size)
            # At most all but its newest token (less: a prompt, or a
            # preempted request's recompute, in chunks).
            assert request.num_computed_tokens <= request.num_tokens - 1
        for block_id in ids:
            holders[block_id] += 1
    assert [b.ref_cnt for b in kv.block_pool.blocks] == holders


def drive_spec(
    sched: Scheduler,
    runner: SpecFakeRunner,
    arrivals: dict[int, list[Request]],
    aborts: dict[int, list[str]] | None = None,
    depth: int = 1,
) -> Run:
    """The engine's loop (``tests/engine/test_scheduler.py``'s ``drive``) with
    speculation: ``depth`` steps in flight (2 with async scheduling: the
    runner executes each step at once, in order, as the ranks would)."""
    aborts = dict(aborts or {})
    run = Run()
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for step in range(2000):
        for request in arrivals.pop(step, []):
            sched.add_request(request)
        sched.finish_requests(aborts.pop(step, []), RequestStatus.FINISHED_ABORTED)
        if not sched.has_requests() and not arrivals and not in_flight:
            break
        if len(in_flight) < depth and (sched.has_work_to_schedule() or not in_flight):
            out = sched.schedule()
            check_step(sched, out)
            run.outputs.append(out)
            in_flight.append((out, runner.execute(out)))
            if len(in_flight) < depth:
                continue
        out, runner_output = in_flight.popleft()
        core = sched.update_from_output(out, runner_output)
        for req_id, co in core.items():
            assert req_id not in run.finish, "output after the finish"
            run.tokens.setdefault(req_id, []).extend(co.new_token_ids)
            if co.finish_reason is not None:
                run.finish[req_id] = co.finish_reason
                run.stop_reason[req_id] = co.stop_reason
        if not in_flight:
            check_spec_kv(sched)
    else:
        pytest.fail("the scheduler did not finish")
    assert_all_blocks_free(sched)
    assert runner.states == {}
    return run


def check_against_reference(
    run: Run, requests: list[Request], max_seq_len: int = 128, token_fn: TokenFn = repeating_token
) -> None:
    for request in requests:
        tokens, finish, stop_reason = reference(request, max_seq_len, token_fn)
        assert run.tokens[request.request_id] == tokens, request.request_id
        assert run.finish[request.request_id] == finish
        assert run.stop_reason[request.request_id] == stop_reason


def test_drafts_are_extra_query_tokens_within_the_budget_and_rolled_back() -> None:
    sched = make_spec_scheduler(budget=64)
    runner = SpecFakeRunner(4)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    request = make_request("a", prompt, max_tokens=30, ignore_eos=True)
    run = drive_spec(sched, runner, {0: [request]})
    drafted = [o for o in run.outputs if o.scheduled_spec_decode_tokens]
    assert drafted, "a repeating prompt gets drafts"
    first = drafted[0]
    # The first decode after the prompt (whose first token continued the
    # pattern): drafts continue it.
    assert run.tokens["a"][0] == 3
    assert first.scheduled_spec_decode_tokens["a"] == [4, 5, 1, 2]
    assert first.num_scheduled_tokens["a"] == 5 == first.total_num_scheduled_tokens
    stats = sched.statistics().spec_decoding
    assert stats is not None and stats.num_draft_tokens == runner.num_draft_tokens
    assert stats.num_accepted_tokens == runner.num_accepted > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "some drafts are rejected"
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1]
    assert len(run.outputs) < 30, "fewer steps than tokens"
    check_against_reference(run, [request])


def test_a_small_budget_trims_the_drafts() -> None:
    sched = make_spec_scheduler(budget=3, k=4)
    request = make_request("a", [7, 8, 7, 8, 7], max_tokens=12, ignore_eos=True)
    run = drive_spec(sched, SpecFakeRunner(4), {0: [request]})
    drafts = [len(d) for o in run.outputs for d in o.scheduled_spec_decode_tokens.values()]
    assert drafts and max(drafts) == 2  # 1 + 2 tokens fill the budget of 3
    check_against_reference(run, [request])


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 7, 13])
def test_max_tokens_is_exact_inside_an_accepted_run(max_tokens: int) -> None:
    # A prompt of a period-5 pattern: the target repeats it, drafts are all accepted.
    sched = make_spec_scheduler(k=4)
    request = make_request("a", [1, 2, 3, 4, 5] * 3, max_tokens=max_tokens, ignore_eos=True)
    run = drive_spec(sched, SpecFakeRunner(4), {0: [request]})
    assert len(run.tokens["a"]) == max_tokens and run.finish["a"] == FinishReason.LENGTH
    for out in run.outputs:  # no draft reaches past max_tokens
        for drafts in out.scheduled_spec_decode_tokens.values():
            assert out.num_scheduled_tokens["a"] <= max_tokens
            assert len(drafts) >= 1
    check_against_reference(run, [request])


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there() -> None:
    prompt = [1, 2, 3, 4, 5] * 3
    alone = make_request("x", prompt, max_tokens=20, ignore_eos=True)
    plain = reference(alone, 128, repeating_token)
    stop = plain[0][6]
    request = make_request("a", prompt, max_tokens=20, stop_token_ids=[stop])
    run = drive_spec(make_spec_scheduler(), SpecFakeRunner(4), {0: [request]})
    assert run.tokens["a"][-1] == stop and run.finish["a"] == FinishReason.STOP
    assert run.stop_reason["a"] == stop
    check_against_reference(run, [request])


def test_the_context_limit_is_exact_with_drafts() -> None:
    request = make_request("a", [1, 2, 3, 4, 5] * 3, max_tokens=100, ignore_eos=True)
    sched = make_spec_scheduler(max_model_len=24)
    run = drive_spec(sched, SpecFakeRunner(4), {0: [request]})
    assert len(run.tokens["a"]) == 24 - 15 and run.finish["a"] == FinishReason.LENGTH
    check_against_reference(run, [request], max_seq_len=24)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [64, 12])
def test_many_requests_preemption_prefix_caching_and_aborts(
    prefix_caching: bool, num_blocks: int, overlap: bool
) -> None:
    """Requests arriving over time, sharing prefixes, some with EOS in
    reach, one aborted; a tight cache preempts."""
    shared = [1, 2, 3, 4, 5, 1, 2, 3]
    requests = [
        make_request(f"r{i}", shared + prompt_of(i, i % 4), max_tokens=8 + 3 * i, eos=(EOS,))
        for i in range(6)
    ]
    requests.append(make_request("same", shared, max_tokens=15, ignore_eos=True))
    requests.append(make_request("same2", shared, max_tokens=15, ignore_eos=True))
    aborted = make_request("gone", prompt_of(9, 10), max_tokens=40)
    sched = make_spec_scheduler(
        num_blocks=num_blocks, prefix_caching=prefix_caching, budget=16, async_scheduling=overlap
    )
    runner = SpecFakeRunner(4)
    arrivals = {0: [*requests[:3], aborted], 2: requests[3:6], 5: requests[6:]}
    depth = 2 if overlap else 1
    run = drive_spec(sched, runner, arrivals, aborts={6: ["gone"]}, depth=depth)
    check_against_reference(run, requests)
    assert aborted.status == RequestStatus.FINISHED_ABORTED and "gone" not in run.finish
    assert run.tokens["same"] == run.tokens["same2"]
    assert runner.num_accepted > 0
    assert any(o.scheduled_spec_decode_tokens for o in run.outputs)
    if num_blocks == 12:
        assert sched.num_preemptions > 0
    if prefix_caching:
        assert sched.kv_cache_manager.statistics().prefix_cache_hits > 0


def test_requests_that_cannot_speculate_get_no_drafts() -> None:
    prompt = [1, 2, 3, 4, 5] * 3
    requests = [
        make_request("prompt_logprobs", prompt, max_tokens=6, prompt_logprobs=1),
        make_request("penalty", prompt, max_tokens=6, presence_penalty=0.5),
        make_request("min_tokens", prompt, max_tokens=6, min_tokens=2),
        make_request("plain", prompt, max_tokens=6),
    ]
    run = drive_spec(make_spec_scheduler(), SpecFakeRunner(4), {0: requests})
    drafted = {r for o in run.outputs for r in o.scheduled_spec_decode_tokens}
    assert drafted == {"plain"}
    check_against_reference(run, requests)


def test_drafts_preempt_nobody() -> None:
    """A step whose decodes fit but whose drafts would need a block that is
    not free: the decodes go without drafts, nobody is preempted."""
    sched = make_spec_scheduler(num_blocks=4)  # two 7-token prompts fill them
    runner = SpecFakeRunner(4)
    runner.token_fn = lambda tokens: tokens[-3]  # period 3: drafts always found
    a = make_request("a", [1, 2, 3, 1, 2, 3, 1], max_tokens=6, ignore_eos=True)
    b = make_request("b", [4, 5, 6, 4, 5, 6, 4], max_tokens=6, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # the prompts: 2 blocks each, none left
    sched.update_from_output(out, runner.execute(out))
    assert sched.kv_cache_manager.num_free_blocks == 0
    out = sched.schedule()  # position 7 is in each one's 2nd block; drafts need a 3rd
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.scheduled_spec_decode_tokens == {} and sched.num_preemptions == 0
    sched.update_from_output(out, runner.execute(out))
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # 2 blocks free again
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"b": [4, 5, 6]}  # (3: max_tokens)


def test_with_async_scheduling_a_repeating_request_waits_to_speculate() -> None:
    """Two steps in flight: a request whose known tokens end with a
    recurring n-gram waits for its step in flight and then verifies drafts
    (its verify steps alone in flight for it); a request whose tokens never
    recur is scheduled over its placeholders, step after step."""
    sched = make_spec_scheduler(async_scheduling=True)
    runner = SpecFakeRunner(4)
    runner.token_fn = token_fn = lambda tokens: tokens[-3] if tokens[0] == 1 else 100 + len(tokens)
    looping = make_request("loop", [1, 2, 3, 1, 2, 3], max_tokens=20, ignore_eos=True)
    fresh = make_request("fresh", [7, 8, 9], max_tokens=20, ignore_eos=True)
    run = drive_spec(sched, runner, {0: [looping, fresh]}, depth=2)
    check_against_reference(run, [looping, fresh], token_fn=token_fn)
    drafted = [o for o in run.outputs if "loop" in o.scheduled_spec_decode_tokens]
    assert drafted and runner.num_accepted == runner.num_draft_tokens  # all accepted
    assert not any("fresh" in o.scheduled_spec_decode_tokens for o in run.outputs)
    # "fresh" ran in (almost) every step: never waited for its tokens in flight.
    steps = [o for o in run.outputs if "fresh" in o.num_scheduled_tokens]
    assert len(steps) == 20
    # "loop" was never scheduled in two steps in a row after a verify step.
    for i, out in enumerate(run.outputs[:-1]):
        if "loop" in out.scheduled_spec_decode_tokens:
            assert "loop" not in run.outputs[i + 1].num_scheduled_tokens


def test_disable_by_batch_size() -> None:
    """No drafts while at least ``disable_by_batch_size`` requests run; drafts
    again once fewer do."""
    prompt = [1, 2, 3, 4, 5] * 3
    a = make_request("a", prompt, max_tokens=4, ignore_eos=True)
    b = make_request("b", prompt, max_tokens=16, ignore_eos=True)
    sched = make_spec_scheduler(disable_by_batch_size=2)
    run = drive_spec(sched, SpecFakeRunner(4), {0: [a, b]})
    check_against_reference(run, [a, b])
    for out in run.outputs:
        if len(out.num_scheduled_tokens) == 2:
            assert out.scheduled_spec_decode_tokens == {}
    assert any(o.scheduled_spec_decode_tokens for o in run.outputs), "b alone speculates"


# -- property test: random traffic with speculation --------------------------------------


def small_vocab_repeating(tokens: Sequence[int]) -> int:
    """``repeating_token`` over 40 tokens (EOS, 0, happens)."""
    digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    if h % 3 and len(tokens) >= PERIOD:
        return tokens[-PERIOD]
    return h % 40


request_spec = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(1, 20),  # prompt length
    st.integers(1, 16),  # max_tokens
    st.integers(0, 3),  # shares a prefix with family n (0: none)
    st.one_of(st.none(), st.integers(0, 30)),  # abort step
    st.booleans(),  # ignore_eos
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
@given(
    specs=st.lists(request_spec, min_size=1, max_size=8),
    num_blocks=st.integers(5, 14),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 5),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    k=st.integers(1, 6),
)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_random_traffic_with_speculation_matches_the_reference(
    overlap: bool,
    specs: list[tuple[int, int, int, int, int | None, bool]],
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    chunked: bool,
    prefix_caching: bool,
    k: int,
) -> None:
    """Random arrivals, prompts sharing prefixes, aborts, EOS, a small
    cache (preemption), chunked prefills or not, sync or async scheduling:
    every request's tokens are those it makes alone without speculation,
    the fake KV cache always holds the right tokens, no block leaks."""
    block_size, max_model_len = 4, 40
    if not chunked:
        budget = max(budget, 20)  # every prompt must fit one step
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks,
        max_model_len=max_model_len,
        async_scheduling=overlap,
        speculative_config=SpeculativeConfig(
            num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3
        ),
    )
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    reqs: list[Request] = []
    for i, (arrive, length, max_tokens, family, abort, ignore_eos) in enumerate(specs):
        prompt = prompt_of(100 + family, length) if family else prompt_of(i, length)
        prompt[-1] = i
        req = make_request(f"r{i}", prompt, max_tokens, eos=(0,), ignore_eos=ignore_eos)
        if length > num_blocks * block_size:
            with pytest.raises(InvalidRequestError):
                sched.add_request(req)
            continue
        reqs.append(req)
        arrivals.setdefault(arrive, []).append(req)
        if abort is not None:
            aborts.setdefault(max(abort, arrive), []).append(req.request_id)
    runner = SpecFakeRunner(block_size)
    runner.token_fn = small_vocab_repeating
    run = drive_spec(sched, runner, arrivals, aborts, depth=2 if overlap else 1)
    max_seq_len = min(max_model_len, num_blocks * block_size)
    for req in reqs:
        want, reason, stop_reason = reference(req, max_seq_len, small_vocab_repeating)
        got = run.tokens.get(req.request_id, [])
        assert req.output_token_ids == got
        if req.status == RequestStatus.FINISHED_ABORTED:
            assert got == want[: len(got)]
        else:
            assert (got, run.finish[req.request_id]) == (want, reason)
            assert run.stop_reason[req.request_id] == stop_reason


def test_a_request_whose_drafts_never_pass_backs_off() -> None:
    """Drafts the target never takes: after ``m`` verify steps in a row
    with no draft accepted the next ``2**m - 1`` decodes (at most
    ``MAX_SPEC_BACKOFF``) go without drafts, and overlap again with async
    scheduling."""
    from asyncstep.engine.core.step_results import MAX_SPEC_BACKOFF

    class WrongDrafts:
        num_lookahead_tokens = 0

        def propose(self, request_id: str, token_ids: Sequence[int], room: int) -> list[int]:
            return [VOCAB - 1] * min(3, room)

        def may_propose(self, request_id: str, token_ids: Sequence[int]) -> bool:
            return True

        def forget(self, request_id: str) -> None:
            pass

    def never_the_draft(tokens: Sequence[int]) -> int:
        return (tokens[-1] * 7 + len(tokens)) % (VOCAB - 1)

    for async_scheduling in (False, True):
        sched = make_spec_scheduler(
            k=3, max_model_len=512, num_blocks=160, async_scheduling=async_scheduling
        )
        assert sched.drafts is not None
        sched.drafts.proposer = WrongDrafts()  # type: ignore[assignment]
        runner = SpecFakeRunner(4)
        runner.token_fn = never_the_draft
        request = make_request("a", [1, 2, 3] * 6, max_tokens=300, ignore_eos=True)
        run = drive_spec(sched, runner, {0: [request]}, depth=2 if async_scheduling else 1)
        verify_steps = [i for i, o in enumerate(run.outputs) if o.scheduled_spec_decode_tokens]
        assert runner.num_accepted == 0
        gaps = [b - a - 1 for a, b in itertools.pairwise(verify_steps)]
        expected = [min(2**m - 1, MAX_SPEC_BACKOFF) for m in range(1, len(gaps) + 1)]
        assert gaps == expected
        assert len(verify_steps) <= 10  # of ~300 decodes
        check_against_reference(run, [request], max_seq_len=512, token_fn=never_the_draft)


def test_a_draft_models_decodes_get_lookahead_slots() -> None:
    """With ``draft_model`` the drafts come with the output (kept for the
    token count they follow) and a decode gets ``k`` slots past its tokens
    for the draft's proposals."""
    k = 3
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        32,
        max_model_len=128,
        speculative_config=SpeculativeConfig(
            method="draft_model", model="d", num_speculative_tokens=k
        ),
    )
    request = make_request("a", [1, 2, 3, 4, 5, 6], max_tokens=20, ignore_eos=True)
    sched.add_request(request)
    prefill = sched.schedule()
    assert prefill.num_scheduled_tokens == {"a": 6}
    out = ModelRunnerOutput(
        req_ids=["a"],
        req_id_to_index={"a": 0},
        sampled_token_ids=[[7]],
        draft_token_ids={"a": [8, 9, 10]},
    )
    sched.update_from_output(prefill, out)
    verify = sched.schedule()
    assert verify.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    # 7 known tokens, 1 + 3 computed now, 3 lookahead: 13 slots, 4 blocks.
    assert len(sched.kv_cache_manager.get_block_ids("a")) == cdiv(7 + k + k, 4)
    out = ModelRunnerOutput(
        req_ids=["a"],
        req_id_to_index={"a": 0},
        sampled_token_ids=[[8, 11]],
        draft_token_ids={"a": [12, 13, 14]},
    )
    sched.update_from_output(verify, out)
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    nxt = sched.schedule()
    assert nxt.scheduled_spec_decode_tokens == {"a": [12, 13, 14]}
