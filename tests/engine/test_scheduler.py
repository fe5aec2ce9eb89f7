"""The scheduler driven by a fake, deterministic model runner.

The fake runner keeps the runner's side of the protocol (request states, block
tables replaced on resume, blocks appended otherwise) and a fake paged KV
cache: every computed token is written to its slot, and every step "attends"
by reading all earlier positions through the block table and checking they
hold the request's tokens. So a wrong block table, a wrong prefix-cache hit or
a block handed to two requests at once fails the test. The sampled token is a
hash of the whole sequence, so outputs do not depend on batching, chunking,
preemption or prefix caching.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncstep.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from asyncstep.datatypes import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    FinishReason,
    Logprobs,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from asyncstep.engine.core.request import Request, RequestStatus
from asyncstep.engine.core.scheduler import Scheduler
from asyncstep.engine.messages.core_messages import EngineCoreOutput
from asyncstep.errors import ConfigError, InvalidRequestError

TokenFn = Callable[[Sequence[int]], int]
VOCAB = 900
EOS = 999  # the default token function never samples it


def hash_token_fn(vocab: int = VOCAB) -> TokenFn:
    def token_fn(tokens: Sequence[int]) -> int:
        digest = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=8).digest()
        return int.from_bytes(digest, "little") % vocab

    return token_fn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- the fake runner ----------------------------------------------------------


@dataclass
class _RunnerReq:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int
    params: SamplingParams


class FakeRunner:
    """Executes SchedulerOutputs against a fake paged KV cache."""

    def __init__(self, block_size: int, token_fn: TokenFn | None = None) -> None:
        self.block_size = block_size
        self.token_fn = token_fn or hash_token_fn()
        self.states: dict[str, _RunnerReq] = {}
        self.kv: dict[tuple[int, int], tuple[int, int]] = {}  # slot -> (token, position)
        self.sampled_log: list[dict[str, list[int]]] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            assert out.num_scheduled_tokens == {}
            self.sampled_log.append({})
            return EMPTY_MODEL_RUNNER_OUTPUT
        written: set[tuple[int, int]] = set()
        sampled: list[list[int]] = []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            sampled.append(self._run_request(self.states[req_id], num_tokens, written))
        req_ids = list(out.num_scheduled_tokens)
        self.sampled_log.append(dict(zip(req_ids, sampled, strict=True)))
        want_logprobs = any(self.states[r].params.logprobs is not None for r in req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=[[_logprobs(t) for t in toks] for toks in sampled] if want_logprobs else None,
        )

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, "a new request the runner already holds"
            self.states[new.req_id] = _RunnerReq(
                list(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                new.sampling_params,
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.states[req_id]
            assert cached.new_token_ids[i] == []
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
                state.num_computed = cached.num_computed_tokens[i]
            else:
                assert cached.num_computed_tokens[i] == state.num_computed
                state.block_ids.extend(cached.new_block_ids[i])
        scheduled = {n.req_id for n in out.scheduled_new_reqs} | set(cached.req_ids)
        assert scheduled == set(out.num_scheduled_tokens)
        assert len(scheduled) == len(out.scheduled_new_reqs) + cached.num_reqs

    def _run_request(
        self, state: _RunnerReq, num_tokens: int, written: set[tuple[int, int]]
    ) -> list[int]:
        bs = self.block_size
        start, end = state.num_computed, state.num_computed + num_tokens
        assert num_tokens > 0 and end <= len(state.tokens)
        assert len(state.block_ids) == cdiv(end, bs)
        for pos in range(start, end):
            slot = (state.block_ids[pos // bs], pos % bs)
            assert slot not in written, "two requests write one slot in a step"
            written.add(slot)
            self.kv[slot] = (state.tokens[pos], pos)
        for pos in range(end):  # "attention" reads every earlier position
            slot = (state.block_ids[pos // bs], pos % bs)
            assert self.kv.get(slot) == (state.tokens[pos], pos), f"bad KV at {pos}"
        state.num_computed = end
        if end < len(state.tokens):
            return []  # a prompt chunk that is not the last
        token = self.token_fn(state.tokens)
        state.tokens.append(token)
        return [token]


def _logprobs(token: int) -> Logprobs:
    return Logprobs(token_ids=[token], logprobs=[-0.5], sampled_token_rank=1)


# -- driving the loop ---------------------------------------------------------


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    chunked: bool = True,
    max_model_len: int = 128,
    prefix_caching: bool = True,
    async_scheduling: bool = False,
    depth: int = 1,
) -> Scheduler:
    """``depth``: the engine's steps in flight; without placeholders (a
    pipeline) they hold different requests, so ``depth * max_num_seqs`` may
    run at once, as the engine sets it."""
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
        max_num_running_reqs=max_num_seqs * (1 if async_scheduling else depth),
    )


#: How the engine drives the scheduler: (async_scheduling, batch queue depth).
#: "sync": one step at a time; "async": one step ahead with output
#: placeholders; "async3": two steps ahead; "pipeline": three steps in
#: flight, no placeholders (PP = 3).
MODES = {"sync": (False, 1), "async": (True, 2), "async3": (True, 3), "pipeline": (False, 3)}


def make_request(
    req_id: str,
    prompt: Sequence[int],
    max_tokens: int = 8,
    eos: Sequence[int] = (EOS,),
    **params: object,
) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params), eos)  # type: ignore[arg-type]


def prompt_of(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % VOCAB for i in range(length)]


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, FinishReason] = field(default_factory=dict)
    stop_reason: dict[str, int | str | None] = field(default_factory=dict)
    outputs: list[SchedulerOutput] = field(default_factory=list)
    core_outputs: list[dict[str, EngineCoreOutput]] = field(default_factory=list)
    finished_reported: list[str] = field(default_factory=list)


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.scheduler_config
    counts = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(counts.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert all(n > 0 for n in counts.values())
    assert len(counts) <= cfg.max_num_seqs
    assert len(sched.running) <= sched.max_num_running_reqs
    kv = sched.kv_cache_manager
    cached = out.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        if cached.resumed_from_preemption[i]:
            assert cached.new_block_ids[i] == kv.get_block_ids(req_id)
    for new in out.scheduled_new_reqs:
        assert new.block_ids == kv.get_block_ids(new.req_id)


def check_kv_accounting(sched: Scheduler) -> None:
    """Every reference is held by a live request; free blocks are exactly those at 0."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders = [0] * kv.num_blocks
    finishing = sched._finishing.values()
    assert all(r.is_finished and r.num_in_flight_steps > 0 for r in finishing)
    for request in [*sched.requests.values(), *finishing]:
        ids = kv.get_block_ids(request.request_id)
        if request.is_finished:
            pass  # held until its steps in flight are back
        elif request.status == RequestStatus.RUNNING:
            assert len(ids) == cdiv(request.num_computed_tokens, kv.block_size)
        else:
            assert ids == []
        for block_id in ids:
            holders[block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders
    assert set(pool.free_block_ids()) == {i for i, n in enumerate(holders) if n == 0}
    assert kv.num_free_blocks == holders.count(0)
    check_decode_limits(sched)


def check_decode_limits(sched: Scheduler) -> None:
    """Every request holding a block table has a decode limit, and it is exact:
    below it ``allocate_slots(request, 1)`` can have nothing to do."""
    kv = sched.kv_cache_manager
    assert set(kv.decode_limits) == set(kv._req_blocks)
    for req_id, blocks in kv._req_blocks.items():
        limit = len(blocks) * kv.block_size
        if kv.enable_prefix_caching:
            limit = min(limit, (kv._num_cached[req_id] + 1) * kv.block_size)
        assert kv.decode_limits[req_id] == limit


def assert_all_blocks_free(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert not sched.has_unfinished_requests()
    assert sched.requests == {}
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.usage == 0.0


def drive(
    sched: Scheduler,
    runner: FakeRunner,
    arrivals: dict[int, list[Request]] | None = None,
    aborts: dict[int, list[str]] | None = None,
    max_steps: int = 5000,
    depth: int = 1,
) -> Run:
    """Run the engine loop until everything finished and was reported to the runner.

    ``depth`` is the engine's batch queue: with 1 each iteration schedules a
    step and takes its output; with more, an iteration either schedules one
    more step (the runner executes it at once, in order) or takes the output
    of the oldest step in flight, as the engine does.
    """
    arrivals = dict(arrivals or {})
    aborts = dict(aborts or {})
    run = Run()
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for step in range(max_steps):
        for request in arrivals.pop(step, []):
            sched.add_request(request)
        sched.finish_requests(aborts.pop(step, []), RequestStatus.FINISHED_ABORTED)
        if not sched.has_requests() and not arrivals and not in_flight:
            break
        if len(in_flight) < depth and (sched.has_work_to_schedule() or not in_flight):
            out = sched.schedule()
            check_step(sched, out)
            run.outputs.append(out)
            run.finished_reported.extend(out.finished_req_ids)
            in_flight.append((out, runner.execute(out)))
            if len(in_flight) < depth:
                continue
        out, runner_output = in_flight.popleft()
        core = sched.update_from_output(out, runner_output)
        run.core_outputs.append(core)
        for req_id, co in core.items():
            assert co.new_token_ids or co.finished
            assert req_id not in run.finish, "output after the finish"
            run.tokens.setdefault(req_id, []).extend(co.new_token_ids)
            if co.finish_reason is not None:
                run.finish[req_id] = co.finish_reason
                run.stop_reason[req_id] = co.stop_reason
        check_kv_accounting(sched)
    else:
        pytest.fail("the scheduler did not finish")
    assert len(run.finished_reported) == len(set(run.finished_reported))
    assert_all_blocks_free(sched)
    assert runner.states == {}
    return run


def reference(
    request: Request, max_seq_len: int, token_fn: TokenFn | None = None
) -> tuple[list[int], FinishReason, int | None]:
    """What the request yields, run alone with no limits but its own."""
    token_fn = token_fn or hash_token_fn()
    params = request.sampling_params
    tokens = list(request.prompt_token_ids)
    out: list[int] = []
    while True:
        token = token_fn(tokens)
        tokens.append(token)
        out.append(token)
        if not params.ignore_eos and token in request.eos_token_ids:
            return out, FinishReason.STOP, None
        if token in params.stop_token_ids:
            return out, FinishReason.STOP, token
        if len(out) >= params.max_tokens or len(tokens) >= max_seq_len:
            return out, FinishReason.LENGTH, None


def scheduled_steps(run: Run, req_id: str) -> list[int]:
    return [i for i, out in enumerate(run.outputs) if req_id in out.num_scheduled_tokens]


# -- continuous batching and the token budget ----------------------------------


def test_continuous_batching_admits_up_to_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=3)
    reqs = [make_request(f"r{i}", prompt_of(i, 5), max_tokens=3 + i) for i in range(5)]
    run = drive(sched, FakeRunner(4), {0: reqs})
    first = run.outputs[0]
    assert [n.req_id for n in first.scheduled_new_reqs] == ["r0", "r1", "r2"]
    assert first.num_scheduled_tokens == {"r0": 5, "r1": 5, "r2": 5}
    # r3 is admitted in the step after r0 (3 tokens) finished, r4 after r1.
    assert scheduled_steps(run, "r0") == [0, 1, 2]
    assert scheduled_steps(run, "r3")[0] == 3
    assert scheduled_steps(run, "r4")[0] == 4
    assert all(len(out.num_scheduled_tokens) <= 3 for out in run.outputs)
    for req in reqs:
        assert (run.tokens[req.request_id], run.finish[req.request_id]) == reference(req, 128)[:2]


def test_token_budget_is_respected_every_step() -> None:
    sched = make_scheduler(budget=10, max_num_seqs=8)
    reqs = [make_request(f"r{i}", prompt_of(i, 7), max_tokens=4) for i in range(4)]
    run = drive(sched, FakeRunner(4), {0: reqs})
    assert run.outputs[0].num_scheduled_tokens == {"r0": 7, "r1": 3}
    assert all(out.total_num_scheduled_tokens <= 10 for out in run.outputs)
    for req in reqs:
        assert run.tokens[req.request_id] == reference(req, 128)[0]


def test_decodes_are_scheduled_before_new_prompts() -> None:
    sched = make_scheduler(budget=8)
    a = make_request("a", prompt_of(1, 4), max_tokens=5)
    b = make_request("b", prompt_of(2, 20), max_tokens=2)
    run = drive(sched, FakeRunner(4), {0: [a], 1: [b]})
    assert run.outputs[1].num_scheduled_tokens == {"a": 1, "b": 7}
    assert run.outputs[1].scheduled_cached_reqs.req_ids == ["a"]
    assert [n.req_id for n in run.outputs[1].scheduled_new_reqs] == ["b"]


# -- chunked prefill ------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt() -> None:
    sched = make_scheduler(budget=8)
    runner = FakeRunner(4)
    req = make_request("long", prompt_of(3, 20), max_tokens=2)
    run = drive(sched, runner, {0: [req]})
    counts = [out.num_scheduled_tokens.get("long") for out in run.outputs]
    assert counts == [8, 8, 4, 1, None]  # then a step reporting it finished
    assert run.outputs[0].scheduled_new_reqs[0].num_computed_tokens == 0
    assert run.outputs[1].scheduled_cached_reqs.num_computed_tokens == [8]
    assert run.outputs[2].scheduled_cached_reqs.num_computed_tokens == [16]
    assert run.outputs[3].scheduled_cached_reqs.num_computed_tokens == [20]
    # No tokens sampled, and no engine output, for the first two chunks.
    assert [log.get("long") for log in runner.sampled_log[:3]] == [[], [], run.tokens["long"][:1]]
    assert run.core_outputs[0] == {} and run.core_outputs[1] == {}
    assert run.outputs[4].finished_req_ids == ["long"]
    assert run.tokens["long"] == reference(req, 128)[0]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits() -> None:
    sched = make_scheduler(budget=16, chunked=False)
    a = make_request("a", prompt_of(1, 4), max_tokens=4)
    b = make_request("b", prompt_of(2, 4), max_tokens=4)
    c = make_request("c", prompt_of(3, 15), max_tokens=2)
    run = drive(sched, FakeRunner(4), {0: [a, b], 1: [c]})
    # Steps 1-3: a and b decode (2 tokens), 14 left < 15: c waits, unchunked.
    first_c = scheduled_steps(run, "c")[0]
    assert first_c == 4
    assert all("a" not in out.num_scheduled_tokens for out in run.outputs[first_c:])
    assert run.outputs[first_c].num_scheduled_tokens == {"c": 15}
    assert run.tokens["c"] == reference(c, 128)[0]


def test_without_chunked_prefill_a_prompt_over_the_budget_is_rejected() -> None:
    sched = make_scheduler(budget=16, chunked=False)
    with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
        sched.add_request(make_request("big", prompt_of(1, 17)))
    sched.add_request(make_request("ok", prompt_of(1, 16)))


# -- preemption -----------------------------------------------------------------


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_by_recompute_gives_the_same_outputs(prefix_caching: bool) -> None:
    def reqs() -> list[Request]:
        return [make_request(f"r{i}", prompt_of(i, 6), max_tokens=10) for i in range(3)]

    roomy = drive(make_scheduler(num_blocks=64), FakeRunner(4), {0: reqs()})
    sched = make_scheduler(num_blocks=7, prefix_caching=prefix_caching)
    tight_reqs = reqs()
    run = drive(sched, FakeRunner(4), {0: tight_reqs})

    assert run.tokens == roomy.tokens
    assert run.finish == roomy.finish == dict.fromkeys(run.tokens, FinishReason.LENGTH)
    assert sched.statistics().num_preemptions > 0
    assert sum(r.num_preemptions for r in tight_reqs) == sched.num_preemptions
    resumed = [
        (i, rid)
        for i, out in enumerate(run.outputs)
        for rid, flag in zip(
            out.scheduled_cached_reqs.req_ids,
            out.scheduled_cached_reqs.resumed_from_preemption,
            strict=True,
        )
        if flag
    ]
    assert resumed, "a preempted request resumed"
    # The lowest priority (last admitted) request is preempted first.
    assert tight_reqs[2].num_preemptions > 0
    assert tight_reqs[0].num_preemptions == 0


def test_preemption_step_admits_nothing_and_resumed_request_gets_all_blocks() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4)
    runner = FakeRunner(4)
    a = make_request("a", prompt_of(1, 8), max_tokens=6)
    b = make_request("b", prompt_of(2, 8), max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # both prefill: 4 blocks
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("c", prompt_of(3, 2)))
    out = sched.schedule()  # both decode: a takes the 5th block; b needs a 6th -> preempted
    # c would fit in the blocks b gave back, but a step that preempts admits nothing.
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("b") == []
    sched.update_from_output(out, runner.execute(out))
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    run = drive(sched, runner)
    resumed = next(
        o for o in run.outputs if "b" in o.scheduled_cached_reqs.req_ids
    ).scheduled_cached_reqs
    assert resumed.resumed_from_preemption == [True]
    assert run.tokens["b"] == reference(b, 128)[0][1:]  # its first token came before
    assert b.output_token_ids == reference(b, 128)[0]


def test_request_filling_the_whole_cache_stops_by_length() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    req = make_request("r", prompt_of(1, 14), max_tokens=10)
    run = drive(sched, FakeRunner(4), {0: [req]})
    assert run.finish["r"] == FinishReason.LENGTH
    assert len(run.tokens["r"]) == 2  # 16 tokens: the cache is full
    assert run.tokens["r"] == reference(req, 16)[0]


# -- aborts -------------------------------------------------------------------------


def test_abort_running_and_waiting_requests_mid_flight() -> None:
    sched = make_scheduler(max_num_seqs=2)
    a = make_request("a", prompt_of(1, 5), max_tokens=20)
    b = make_request("b", prompt_of(2, 5), max_tokens=20)
    c = make_request("c", prompt_of(3, 5), max_tokens=20)
    run = drive(sched, FakeRunner(4), {0: [a, b, c]}, aborts={3: ["a", "c", "unknown"]})
    assert a.status == c.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == FinishReason.ABORT
    assert len(run.tokens["a"]) == 3 and "c" not in run.tokens
    assert run.outputs[3].finished_req_ids == ["a", "c"]
    assert run.finished_reported.count("a") == 1
    assert run.tokens["b"] == reference(b, 128)[0]


def test_abort_between_schedule_and_update_is_skipped() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4)
    a = make_request("a", prompt_of(1, 5))
    b = make_request("b", prompt_of(2, 5))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    core = sched.update_from_output(out, runner.execute(out))
    assert set(core) == {"b"}
    assert a.output_token_ids == []
    nxt = sched.schedule()
    assert nxt.finished_req_ids == ["a"]
    assert list(nxt.num_scheduled_tokens) == ["b"]
    sched.update_from_output(nxt, runner.execute(nxt))
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    drive(sched, runner)


def test_finish_requests_needs_a_finished_status() -> None:
    sched = make_scheduler()
    with pytest.raises(ValueError, match="FINISHED"):
        sched.finish_requests(["x"], RequestStatus.RUNNING)


# -- stop rules ---------------------------------------------------------------------


def scripted(script: Sequence[int], prompt_len: int) -> TokenFn:
    return lambda tokens: script[len(tokens) - prompt_len]


def test_eos_stops_and_is_included() -> None:
    sched = make_scheduler()
    req = make_request("r", [1, 2, 3], max_tokens=10, eos=(7,))
    run = drive(sched, FakeRunner(4, scripted([5, 6, 7, 8, 9], 3)), {0: [req]})
    assert run.tokens["r"] == [5, 6, 7]
    assert (run.finish["r"], run.stop_reason["r"]) == (FinishReason.STOP, None)
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_past_eos() -> None:
    sched = make_scheduler()
    req = make_request("r", [1, 2, 3], max_tokens=5, eos=(7,), ignore_eos=True)
    run = drive(sched, FakeRunner(4, scripted([5, 6, 7, 8, 9], 3)), {0: [req]})
    assert run.tokens["r"] == [5, 6, 7, 8, 9]
    assert run.finish["r"] == FinishReason.LENGTH


def test_stop_token_id_sets_stop_reason() -> None:
    sched = make_scheduler()
    req = make_request("r", [1, 2, 3], max_tokens=10, stop_token_ids=[8])
    run = drive(sched, FakeRunner(4, scripted([5, 6, 8, 9], 3)), {0: [req]})
    assert run.tokens["r"] == [5, 6, 8]
    assert (run.finish["r"], run.stop_reason["r"]) == (FinishReason.STOP, 8)


def test_max_tokens_and_max_model_len_stop_by_length() -> None:
    sched = make_scheduler(max_model_len=10)
    capped = make_request("tokens", prompt_of(1, 3), max_tokens=2)
    ctx = make_request("ctx", prompt_of(2, 6), max_tokens=50)
    run = drive(sched, FakeRunner(4), {0: [capped, ctx]})
    assert len(run.tokens["tokens"]) == 2
    assert len(run.tokens["ctx"]) == 4  # 6 + 4 = max_model_len
    assert run.finish == {"tokens": FinishReason.LENGTH, "ctx": FinishReason.LENGTH}


def test_tokens_after_a_stop_are_dropped_with_their_logprobs() -> None:
    sched = make_scheduler()
    req = make_request("r", [1, 2, 3], max_tokens=10, eos=(7,), logprobs=1)
    sched.add_request(req)
    out = sched.schedule()
    lps = [_logprobs(t) for t in (5, 7, 9)]
    mro = ModelRunnerOutput(
        req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[5, 7, 9]], logprobs=[lps]
    )
    core = sched.update_from_output(out, mro)
    assert core["r"] == EngineCoreOutput(
        request_id="r",
        new_token_ids=[5, 7],
        finish_reason=FinishReason.STOP,
        stop_reason=None,
        new_logprobs=lps[:2],
    )
    assert req.output_token_ids == [5, 7]
    assert sched.schedule().finished_req_ids == ["r"]
    assert_all_blocks_free(sched)


def test_logprobs_are_passed_through() -> None:
    sched = make_scheduler()
    req = make_request("r", prompt_of(1, 3), max_tokens=3, logprobs=2)
    run = drive(sched, FakeRunner(4), {0: [req]})
    got = [lp for core in run.core_outputs if "r" in core for lp in core["r"].new_logprobs or []]
    assert [lp.token_ids[0] for lp in got] == run.tokens["r"]


# -- finished ids and idle steps ------------------------------------------------------


def test_finished_req_ids_reported_exactly_once_in_the_next_step() -> None:
    sched = make_scheduler()
    runner = FakeRunner(4)
    sched.add_request(make_request("a", prompt_of(1, 3), max_tokens=1))
    sched.add_request(make_request("b", prompt_of(2, 3), max_tokens=3))
    out = sched.schedule()
    core = sched.update_from_output(out, runner.execute(out))
    assert core["a"].finished and not core["b"].finished
    assert sched.has_finished_requests()
    outs = []
    for _ in range(4):
        out = sched.schedule()
        outs.append(out)
        sched.update_from_output(out, runner.execute(out))
    assert [o.finished_req_ids for o in outs] == [["a"], [], ["b"], []]
    assert outs[3].total_num_scheduled_tokens == 0
    assert_all_blocks_free(sched)


def test_zero_token_step_when_idle() -> None:
    sched = make_scheduler()
    assert not sched.has_requests()
    first, second = sched.schedule(), sched.schedule()
    for out in (first, second):
        assert out.total_num_scheduled_tokens == 0
        assert out.num_scheduled_tokens == {}
        assert out.scheduled_new_reqs == []
        assert out.scheduled_cached_reqs.num_reqs == 0
        assert out.finished_req_ids == []
    assert (first.step_id, second.step_id) == (0, 1)
    assert sched.update_from_output(first, EMPTY_MODEL_RUNNER_OUTPUT) == {}
    assert_all_blocks_free(sched)


# -- add_request errors ---------------------------------------------------------------


def test_prompt_longer_than_the_context_is_rejected() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidRequestError) as err:
        sched.add_request(make_request("r", prompt_of(1, 16)))
    assert str(err.value) == "prompt has 16 tokens; the model's context (max_model_len) is 16"
    sched.add_request(make_request("ok", prompt_of(1, 15)))
    assert sched.get_num_unfinished_requests() == 1


def test_prompt_bigger_than_the_cache_is_rejected() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(InvalidRequestError, match="KV cache holds only 16"):
        sched.add_request(make_request("r", prompt_of(1, 17)))
    assert not sched.has_requests()


def test_empty_prompt_and_duplicate_id_are_rejected() -> None:
    sched = make_scheduler()
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add_request(make_request("r", []))
    sched.add_request(make_request("r", [1]))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make_request("r", [2]))


def test_max_model_len_and_the_budget_must_be_set() -> None:
    with pytest.raises(ConfigError, match="max_model_len must be resolved"):
        Scheduler(SchedulerConfig(), CacheConfig(), 8, max_model_len=0)
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be resolved"):
        Scheduler(SchedulerConfig(), CacheConfig(), 8, max_model_len=64)


# -- prefix caching -------------------------------------------------------------------


def test_shared_prefix_shares_blocks() -> None:
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    shared = prompt_of(9, 10)
    a = make_request("a", [*shared, 1], max_tokens=6)
    b = make_request("b", [*shared, 3, 4, 5], max_tokens=6)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.add_request(b)
    out = sched.schedule()
    (new_b,) = out.scheduled_new_reqs
    assert new_b.num_computed_tokens == 8  # two full blocks of the shared 10 tokens
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}
    kv = sched.kv_cache_manager
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert [kv.block_pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    assert sched.statistics().kv_cache.prefix_cache_hits == 8
    sched.update_from_output(out, runner.execute(out))
    run = drive(sched, runner)
    assert a.output_token_ids == reference(a, 128)[0]
    assert b.output_token_ids == reference(b, 128)[0]
    assert run.finish == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


@pytest.mark.parametrize("length", [8, 9, 12])
def test_identical_prompt_never_hits_the_whole_prompt(length: int) -> None:
    sched = make_scheduler(block_size=4)
    prompt = prompt_of(5, length)
    first = make_request("first", prompt, max_tokens=1)
    drive(sched, FakeRunner(4), {0: [first]})
    again = make_request("again", prompt, max_tokens=3)
    sched.add_request(again)
    out = sched.schedule()
    hit = out.scheduled_new_reqs[0].num_computed_tokens
    assert hit == (length - 1) // 4 * 4
    assert 0 < hit < length and hit % 4 == 0
    assert out.num_scheduled_tokens == {"again": length - hit}
    sched.finish_requests("again", RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(out, EMPTY_MODEL_RUNNER_OUTPUT)  # the step came back
    sched.schedule()
    assert_all_blocks_free(sched)


def test_prefix_cache_hits_give_the_right_outputs() -> None:
    sched = make_scheduler(block_size=4, num_blocks=32)
    runner = FakeRunner(4)
    base = prompt_of(11, 13)
    reqs = [make_request(f"r{i}", [*base[: 5 + i * 2], i], max_tokens=5) for i in range(5)]
    arrivals = {i * 3: [r] for i, r in enumerate(reqs)}
    run = drive(sched, runner, arrivals)
    for req in reqs:
        assert run.tokens[req.request_id] == reference(req, 128)[0]
    stats = sched.statistics().kv_cache
    assert stats.prefix_cache_hits > 0


def test_repeated_blocks_at_other_positions_give_the_right_outputs() -> None:
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(4)
    pattern = [7, 8, 9, 10]
    reqs = [
        make_request("a", [1, 2, 3, 4, *pattern, *pattern, 5], max_tokens=3),
        make_request("b", [*pattern, *pattern, *pattern, 6], max_tokens=3),
        make_request("c", [*pattern, 1, 2, 3, 4, *pattern, 6], max_tokens=3),
    ]
    run = drive(sched, runner, {0: reqs[:1], 3: reqs[1:2], 6: reqs[2:]})
    for req in reqs:
        assert run.tokens[req.request_id] == reference(req, 128)[0]
    assert sched.statistics().kv_cache.prefix_cache_hits == 4  # c's first block, from b


def test_same_step_shared_prompts_do_not_hit_uncomputed_blocks() -> None:
    sched = make_scheduler(block_size=4)
    prompt = prompt_of(4, 12)
    a, b = make_request("a", prompt, max_tokens=2), make_request("b", prompt, max_tokens=2)
    runner = FakeRunner(4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert [n.num_computed_tokens for n in out.scheduled_new_reqs] == [0, 0]
    sched.update_from_output(out, runner.execute(out))
    kv = sched.kv_cache_manager
    assert set(kv.get_block_ids("a")).isdisjoint(kv.get_block_ids("b"))
    drive(sched, runner)
    assert a.output_token_ids == b.output_token_ids == reference(a, 128)[0]


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4)
    runner = FakeRunner(4)
    a = make_request("a", prompt_of(1, 8), max_tokens=8)
    b = make_request("b", prompt_of(2, 8), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run = drive(sched, runner)
    assert b.num_preemptions >= 1
    resumed_hits = [
        out.scheduled_cached_reqs.num_computed_tokens[i]
        for out in run.outputs
        for i, flag in enumerate(out.scheduled_cached_reqs.resumed_from_preemption)
        if flag
    ]
    assert resumed_hits and resumed_hits[0] > 0
    assert a.output_token_ids == reference(a, 128)[0]
    assert b.output_token_ids == reference(b, 128)[0]


# -- the decode fast path --------------------------------------------------------------


class NoDecodeLimits(dict[str, int]):
    """``decode_limits`` that never allow the fast path: every decode goes
    through ``allocate_slots``' general path, as before the fast path existed."""

    def get(self, key: str, default: int | None = None) -> int | None:  # type: ignore[override]
        return default


def without_fast_path(sched: Scheduler) -> Scheduler:
    sched.kv_cache_manager.decode_limits = NoDecodeLimits()
    return sched


def counting_allocations(sched: Scheduler) -> list[tuple[int, str, int, int]]:
    """Record (step id, request id, num_computed_tokens, num_new) of every
    ``allocate_slots`` call."""
    kv = sched.kv_cache_manager
    calls: list[tuple[int, str, int, int]] = []
    allocate = kv.allocate_slots

    def spy(request: Request, num_new_tokens: int) -> list[int] | None:
        calls.append(
            (sched.step_id, request.request_id, request.num_computed_tokens, num_new_tokens)
        )
        return allocate(request, num_new_tokens)

    kv.allocate_slots = spy  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("mode", list(MODES))
def test_decode_inside_a_block_skips_the_allocator_and_crosses_boundaries(mode: str) -> None:
    async_scheduling, depth = MODES[mode]
    sched = make_scheduler(async_scheduling=async_scheduling, depth=depth, block_size=4)
    calls = counting_allocations(sched)
    a = make_request("a", prompt_of(1, 6), max_tokens=11)  # 6 + 11 = 17 tokens: 5 blocks
    run = drive(sched, FakeRunner(4), {0: [a]}, depth=depth)
    assert a.output_token_ids == reference(a, 128)[0]
    # Only the prompt and the decodes that start a block (token 8, 12, 16, ...)
    # or follow a block filled (with placeholders: once its last id is known)
    # reach the allocator; the others take the fast path.
    decode_calls = [(c, n) for _, _, c, n in calls if n == 1]
    assert calls[0] == (0, "a", 0, 6)
    assert {c for c, _ in decode_calls} >= {8, 12}
    assert len(decode_calls) < len(a.output_token_ids) - 1
    # Block ids arrive exactly at the boundaries: one new block each time.
    appended = [
        (
            out.scheduled_cached_reqs.num_computed_tokens[0],
            out.scheduled_cached_reqs.new_block_ids[0],
        )
        for out in run.outputs
        if out.scheduled_cached_reqs.req_ids == ["a"]
    ]
    assert [c for c, ids in appended if ids] == [8, 12]
    assert all(len(ids) <= 1 for _, ids in appended)


def test_fast_path_registers_full_blocks_for_prefix_caching() -> None:
    # a decodes past two block boundaries; b, sharing a's prompt and outputs,
    # arrives later and must hit every full block a computed.
    sched = make_scheduler(block_size=4, max_num_seqs=2)
    a = make_request("a", prompt_of(1, 5), max_tokens=9)
    runner = FakeRunner(4)
    sched.add_request(a)
    for _ in range(8):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert a.num_computed_tokens == 12  # 5 + 7 decodes: three full blocks computed
    kv = sched.kv_cache_manager
    # Registration is lazy: block 2, full since the last step, is not in yet.
    assert kv.block_pool.num_cached_blocks == 2 and kv.decode_limits["a"] == 12
    b = make_request("b", list(a.all_token_ids)[:13])
    sched.add_request(b)
    out = sched.schedule()  # a, scheduled first, registers block 2: b hits it
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert kv.get_block_ids("b")[:3] == kv.get_block_ids("a")[:3]
    sched.update_from_output(out, runner.execute(out))
    drive(sched, runner)
    assert b.output_token_ids == reference(b, 128)[0]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("rule", ["stop_token", "eos", "max_tokens"])
def test_stop_on_a_block_boundary_token(mode: str, rule: str) -> None:
    """The last token is the first of a fresh block (or the second): with a step
    in flight the step after the stop may already hold a block for the dropped
    token; everything must still be freed, once, and the full blocks cached."""
    async_scheduling, depth = MODES[mode]
    for num_outputs in (2, 3):  # the last token at position 8 (a new block) or 9
        sched = make_scheduler(async_scheduling=async_scheduling, depth=depth, block_size=4)
        probe = make_request("a", prompt_of(1, 7), max_tokens=20)
        want = reference(probe, 128)[0][:num_outputs]
        last = want[-1]
        if last in want[:-1]:
            continue  # the stop would fire earlier
        if rule == "stop_token":
            a = make_request("a", prompt_of(1, 7), max_tokens=20, stop_token_ids=[last])
        elif rule == "eos":
            a = make_request("a", prompt_of(1, 7), max_tokens=20, eos=(last,))
        else:
            a = make_request("a", prompt_of(1, 7), max_tokens=num_outputs)
        run = drive(sched, FakeRunner(4), {0: [a]}, depth=depth)
        assert a.output_token_ids == run.tokens["a"] == want
        reason = FinishReason.LENGTH if rule == "max_tokens" else FinishReason.STOP
        assert run.finish["a"] == reason
        assert run.stop_reason["a"] == (last if rule == "stop_token" else None)
        assert run.finished_reported == ["a"]
        kv = sched.kv_cache_manager
        assert kv.decode_limits == {}
        # The computed full blocks (the 8 tokens before the last) stay cached.
        again = make_request("again", list(a.all_token_ids))
        assert kv.get_computed_blocks(again)[1] == 8
        kv.free(again)


def test_preempted_fast_path_request_loses_its_decode_limit() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4)
    calls = counting_allocations(sched)
    runner = FakeRunner(4)
    a = make_request("a", prompt_of(1, 8), max_tokens=8)
    b = make_request("b", prompt_of(2, 6), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    kv = sched.kv_cache_manager

    def step() -> SchedulerOutput:
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
        return out

    step()  # a: blocks 0-1, b: blocks 2-3
    # b's block 0 is full but not registered yet: its first decode takes the general path.
    assert kv.decode_limits["b"] == 4
    assert step().scheduled_cached_reqs.new_block_ids == [[4], []]
    assert kv.decode_limits == {"a": 12, "b": 8}
    assert step().num_scheduled_tokens == {"a": 1, "b": 1}  # both on the fast path
    assert not [c for c in calls if c[0] == 2]
    assert step().scheduled_cached_reqs.new_block_ids == [[], [5]]  # b's 3rd block: cache full
    assert step().num_scheduled_tokens == {"a": 1, "b": 1}
    assert not [c for c in calls if c[0] == 4]  # b decodes inside its block
    # a starts a 4th block, none is free: b, last, is preempted from the fast path.
    out = step()
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert "b" not in kv.decode_limits and kv.get_block_ids("b") == []
    check_kv_accounting(sched)
    run = drive(sched, runner)
    assert any(True in o.scheduled_cached_reqs.resumed_from_preemption for o in run.outputs)
    assert a.output_token_ids == reference(a, 128)[0]
    assert b.output_token_ids == reference(b, 128)[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_preemption_of_a_request_on_the_fast_path(mode: str) -> None:
    """As above with steps in flight: b decodes on the fast path, then a needs
    a block the cache lacks and preempts it (maybe with a step in flight)."""
    async_scheduling, depth = MODES[mode]
    sched = make_scheduler(
        async_scheduling=async_scheduling, depth=depth, num_blocks=6, block_size=4
    )
    calls = counting_allocations(sched)
    a = make_request("a", prompt_of(1, 8), max_tokens=8)
    b = make_request("b", prompt_of(2, 6), max_tokens=8)
    run = drive(sched, FakeRunner(4), {0: [a, b]}, depth=depth)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    resume = min(
        i
        for i, out in enumerate(run.outputs)
        if any(out.scheduled_cached_reqs.resumed_from_preemption)
    )
    allocated = {(step, rid) for step, rid, _, _ in calls}
    fast = [
        i
        for i in scheduled_steps(run, "b")
        if i < resume
        and (i, "b") not in allocated
        and run.outputs[i].num_scheduled_tokens["b"] == 1
    ]
    assert fast, "b decoded on the fast path before its preemption"
    assert a.output_token_ids == reference(a, 128)[0]
    assert b.output_token_ids == reference(b, 128)[0]


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 8), st.integers(1, 14), st.integers(1, 12), st.integers(0, 2)),
        min_size=1,
        max_size=8,
    ),
    num_blocks=st.integers(5, 12),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 5),
    prefix_caching=st.booleans(),
)
@pytest.mark.parametrize("mode", list(MODES))
def test_fast_path_changes_nothing(
    mode: str,
    specs: list[tuple[int, int, int, int]],
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    prefix_caching: bool,
) -> None:
    """With the decode fast path and without it (every decode through the
    allocator's general path) the scheduler makes the same steps, outputs,
    prefix-cache registrations and free queue."""
    async_scheduling, depth = MODES[mode]
    token_fn = hash_token_fn(vocab=40)

    def run(fast: bool) -> tuple[Run, list[object]]:
        sched = make_scheduler(
            async_scheduling=async_scheduling,
            depth=depth,
            num_blocks=num_blocks,
            block_size=4,
            budget=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=40,
            prefix_caching=prefix_caching,
        )
        if not fast:
            without_fast_path(sched)
        arrivals: dict[int, list[Request]] = {}
        for i, (arrive, length, max_tokens, family) in enumerate(specs):
            prompt = prompt_of(100 + family, length) if family else prompt_of(i, length)
            arrivals.setdefault(arrive, []).append(
                make_request(f"r{i}", prompt, max_tokens, eos=(0,))
            )
        result = drive(sched, FakeRunner(4, token_fn), arrivals, depth=depth)
        pool = sched.kv_cache_manager.block_pool
        state: list[object] = [
            [b.block_hash for b in pool.blocks],
            pool.free_block_ids(),
            sched.statistics(),
        ]
        return result, state

    fast, fast_state = run(True)
    slow, slow_state = run(False)
    assert fast.outputs == slow.outputs
    assert fast.core_outputs == slow.core_outputs
    assert fast_state == slow_state


# -- requests' derived stop rules ----------------------------------------------------


def test_request_derives_its_stop_rules_and_refreshes_them() -> None:
    r = make_request("r", [1, 2, 3], max_tokens=5, eos=(7,), stop_token_ids=[9])
    assert (r.num_tokens, r.max_num_tokens) == (3, 8)
    assert r.stop_ids == {7, 9}
    r.append_output_token_id(4)
    r.append_output_token_ids([5, 6])
    r.append_output_token_ids(8)
    assert r.num_tokens == len(r.all_token_ids) == 7 and r.output_token_ids == [4, 5, 6, 8]
    r.sampling_params = SamplingParams(max_tokens=2, ignore_eos=True, stop_token_ids=(3,))
    assert (r.max_num_tokens, r.stop_ids) == (5, {3})
    r.sampling_params = SamplingParams(max_tokens=2)
    r.eos_token_ids = [11, 12]
    assert r.stop_ids == {11, 12} and r.eos_token_ids == frozenset({11, 12})
    assert not r.is_finished and r.finish_reason is None
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.is_finished and r.finish_reason == FinishReason.LENGTH


def test_eos_that_is_also_a_stop_token_reports_no_stop_reason() -> None:
    probe = make_request("a", prompt_of(1, 5))
    first = reference(probe, 128)[0][0]
    a = make_request("a", prompt_of(1, 5), eos=(first,), stop_token_ids=[first])
    run = drive(make_scheduler(), FakeRunner(4), {0: [a]})
    assert (run.tokens["a"], run.finish["a"], run.stop_reason["a"]) == (
        [first],
        FinishReason.STOP,
        None,
    )
    b = make_request("b", prompt_of(1, 5), eos=(first,), stop_token_ids=[first], ignore_eos=True)
    run = drive(make_scheduler(), FakeRunner(4), {0: [b]})
    assert run.stop_reason["b"] == first


# -- statistics ----------------------------------------------------------------------


def test_statistics() -> None:
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    sched.add_request(make_request("a", prompt_of(1, 6)))
    sched.add_request(make_request("b", prompt_of(2, 6)))
    out = sched.schedule()
    stats = sched.statistics()
    assert (stats.step_id, stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1, 1)
    assert stats.kv_cache.num_free_blocks == 8
    assert stats.kv_cache_usage == pytest.approx(0.2)
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    # "a" is in a step in flight: its blocks are held until that step is back.
    assert sched.statistics().kv_cache_usage == pytest.approx(0.2)
    sched.update_from_output(out, FakeRunner(4).execute(out))
    assert sched.statistics().kv_cache_usage == 0.0


# -- property test: random traffic on a small cache -------------------------------------

request_spec = st.tuples(
    st.integers(0, 12),  # arrival step
    st.integers(1, 20),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(0, 3),  # shares a prefix with family n (0: none)
    st.one_of(st.none(), st.integers(0, 30)),  # abort step
    st.booleans(),  # ignore_eos
)


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
    database=None,
)
@given(
    specs=st.lists(request_spec, min_size=1, max_size=10),
    num_blocks=st.integers(5, 12),
    budget=st.integers(4, 24),
    max_num_seqs=st.integers(1, 5),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
)
@pytest.mark.parametrize("mode", list(MODES))
def test_random_traffic_never_leaks_and_matches_the_reference(
    mode: str,
    specs: list[tuple[int, int, int, int, int | None, bool]],
    num_blocks: int,
    budget: int,
    max_num_seqs: int,
    chunked: bool,
    prefix_caching: bool,
) -> None:
    block_size, max_model_len = 4, 40
    if not chunked:
        budget = max(budget, 20)  # every prompt must fit one step
    token_fn = hash_token_fn(vocab=40)  # small vocabulary: EOS (0) happens
    async_scheduling, depth = MODES[mode]
    sched = make_scheduler(
        async_scheduling=async_scheduling,
        depth=depth,
        num_blocks=num_blocks,
        block_size=block_size,
        budget=budget,
        max_num_seqs=max_num_seqs,
        chunked=chunked,
        max_model_len=max_model_len,
        prefix_caching=prefix_caching,
    )
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    reqs: list[Request] = []
    for i, (arrive, length, max_tokens, family, abort, ignore_eos) in enumerate(specs):
        prompt = prompt_of(100 + family, length) if family else prompt_of(i, length)
        prompt[-1] = i  # prompts of a family share a prefix, not all their tokens
        req = make_request(f"r{i}", prompt, max_tokens, eos=(0,), ignore_eos=ignore_eos)
        if length > num_blocks * block_size:
            with pytest.raises(InvalidRequestError):
                sched.add_request(req)
            continue
        reqs.append(req)
        arrivals.setdefault(arrive, []).append(req)
        if abort is not None:
            aborts.setdefault(max(abort, arrive), []).append(req.request_id)
    run = drive(sched, FakeRunner(block_size, token_fn), arrivals, aborts, depth=depth)
    max_seq_len = min(max_model_len, num_blocks * block_size)
    for req in reqs:
        want, reason, stop_reason = reference(req, max_seq_len, token_fn)
        got = run.tokens.get(req.request_id, [])
        assert req.output_token_ids == got
        if req.status == RequestStatus.FINISHED_ABORTED:
            assert got == want[: len(got)]
            assert req.request_id not in run.finish
        else:
            assert (got, run.finish[req.request_id]) == (want, reason)
            assert run.stop_reason[req.request_id] == stop_reason


# -- several steps in flight: async scheduling and pipeline parallelism ----------------


def test_async_scheduling_schedules_the_next_step_over_a_placeholder() -> None:
    sched = make_scheduler(async_scheduling=True)
    runner = FakeRunner(4)
    a = make_request("a", prompt_of(1, 5), max_tokens=3)
    sched.add_request(a)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 5}
    assert a.num_output_placeholders == 1
    # Step 1 is scheduled before step 0's token is known: it computes that token.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    assert (a.num_output_placeholders, a.num_computed_tokens, a.num_tokens) == (2, 6, 5)
    out0, out1 = runner.execute(first), runner.execute(second)
    sched.update_from_output(first, out0)
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    # Three tokens are due (max_tokens): one known, two in flight: nothing to schedule.
    assert (a.num_output_tokens, a.num_output_placeholders) == (1, 2)
    assert not sched.has_work_to_schedule()
    sched.update_from_output(second, out1)
    sched.update_from_output(third, runner.execute(third))
    run = drive(sched, runner, depth=2)
    assert a.output_token_ids == reference(a, 128)[0]
    assert run.finished_reported == ["a"] and not run.outputs[-1].num_scheduled_tokens


def test_late_stop_drops_the_extra_token_and_frees_blocks_after_its_step() -> None:
    sched = make_scheduler(async_scheduling=True)
    a = make_request("a", prompt_of(1, 5), max_tokens=10)
    # The second sampled token is a stop token.
    stop = reference(a, 128)[0][1]
    a.sampling_params = SamplingParams(max_tokens=10, stop_token_ids=[stop])
    runner = FakeRunner(4)
    sched.add_request(a)
    steps = [sched.schedule(), sched.schedule()]
    outputs = [runner.execute(s) for s in steps]
    sched.update_from_output(steps[0], outputs[0])
    steps.append(sched.schedule())  # the third step samples past the stop
    outputs.append(runner.execute(steps[2]))
    core = sched.update_from_output(steps[1], outputs[1])
    assert core["a"].finish_reason == FinishReason.STOP and core["a"].stop_reason == stop
    # Its blocks stay with the step in flight; it is not reported finished yet.
    assert sched.kv_cache_manager.get_block_ids("a") != []
    assert not sched.schedule().finished_req_ids
    assert sched.update_from_output(steps[2], outputs[2]) == {}  # the extra token is dropped
    assert a.output_token_ids == reference(a, 128)[0][:2]
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    assert sched.schedule().finished_req_ids == ["a"]


def test_pipeline_mode_waits_for_a_token_before_scheduling_its_request_again() -> None:
    sched = make_scheduler(budget=5)
    a, b = make_request("a", prompt_of(1, 5)), make_request("b", prompt_of(2, 5))
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 5}
    # While step 0 is in flight, b's prompt goes in the second step, not a's decode.
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"b": 5}
    assert not sched.has_work_to_schedule()


def test_pipeline_steps_in_flight_hold_different_full_batches() -> None:
    # PP = 2, two requests a step: four run at once, two in each step in flight.
    sched = make_scheduler(max_num_seqs=2, depth=2)
    reqs = [make_request(f"r{i}", prompt_of(i, 3)) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    first, second = sched.schedule(), sched.schedule()
    assert list(first.num_scheduled_tokens) == ["r0", "r1"]
    assert list(second.num_scheduled_tokens) == ["r2", "r3"]
    assert len(sched.running) == 4 and [r.request_id for r in sched.waiting] == ["r4"]
    assert not sched.has_work_to_schedule()  # all four are in flight; r4 has no room
    runner = FakeRunner(4)
    sched.update_from_output(first, runner.execute(first))
    third = sched.schedule()
    assert list(third.num_scheduled_tokens) == ["r0", "r1"]  # r4 waits: four run already
    sched.update_from_output(second, runner.execute(second))
    sched.update_from_output(third, runner.execute(third))
    run = drive(sched, runner, depth=2)
    assert all(len(out.num_scheduled_tokens) <= 2 for out in run.outputs)
    for req in reqs:
        assert req.output_token_ids == reference(req, 128)[0]


def test_running_cap_below_max_num_seqs_is_rejected() -> None:
    with pytest.raises(ConfigError, match="max_num_running_reqs"):
        Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
            CacheConfig(block_size=4),
            16,
            max_model_len=32,
            max_num_running_reqs=2,
        )


@pytest.mark.parametrize("mode", list(MODES))
def test_abort_with_steps_in_flight_frees_blocks_once_they_are_back(mode: str) -> None:
    async_scheduling, depth = MODES[mode]
    sched = make_scheduler(async_scheduling=async_scheduling, depth=depth, budget=8)
    reqs = [make_request(f"r{i}", prompt_of(i, 6), max_tokens=6) for i in range(4)]
    run = drive(sched, FakeRunner(4), {0: reqs}, {3: ["r0", "r2"]}, depth=depth)
    assert run.finished_reported.count("r0") == 1
    for req in reqs:
        want = reference(req, 128)[0]
        assert req.output_token_ids == want[: len(req.output_token_ids)]


@pytest.mark.parametrize(
    "async_scheduling,pp,asked,depth,running",
    [
        (False, 1, 0, 1, 8),  # one step at a time
        (True, 1, 0, 2, 8),  # overlap: one step ahead, over placeholders
        (True, 1, 3, 3, 8),  # two steps ahead, still the same requests
        (True, 2, 0, 2, 16),  # a pipeline: different requests in each step in flight
        (False, 4, 0, 4, 32),
    ],
)
def test_engine_config_batch_queue_and_running_requests(
    async_scheduling: bool, pp: int, asked: int, depth: int, running: int
) -> None:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_seqs=8, async_scheduling=async_scheduling, max_concurrent_batches=asked
        ),
        parallel=ParallelConfig(pipeline_parallel_size=pp),
    )
    assert (config.batch_queue_size, config.max_num_running_reqs) == (depth, running)


def test_negative_max_concurrent_batches_is_rejected() -> None:
    with pytest.raises(ConfigError, match="max_concurrent_batches must be 0"):
        SchedulerConfig(max_concurrent_batches=-1)


@pytest.mark.parametrize("seconds", [0.0, -1e-3])
def test_bad_gil_switch_interval_is_rejected(seconds: float) -> None:
    with pytest.raises(ConfigError, match="gil_switch_interval_s must be positive"):
        SchedulerConfig(gil_switch_interval_s=seconds)
