"""The runner's fast paths (the steady decode step: inputs in a few array
operations, the persistent batch updated without per-request Python, the
staged block table rewritten only where it changed, the sampling metadata
reused) against its general path: two runners on the same weights, one with
``fast_paths`` off, driven in lockstep by the real scheduler through random
workloads (requests joining and leaving, aborts, preemption on a small KV
cache, chunked prompts, prefix-cache hits, new blocks), each step's inputs
and the batches' state compared."""

from __future__ import annotations

import copy
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncstep.config import CacheConfig, CompilationConfig, SchedulerConfig
from asyncstep.datatypes import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from asyncstep.engine.core.request import Request, RequestStatus
from asyncstep.engine.core.scheduler import Scheduler
from asyncstep.models.model_loader import LoadedModel
from asyncstep.ops.attention import _cuts
from asyncstep.runner import cudagraph_runner as cudagraph_runner_module
from asyncstep.runner import model_runner as model_runner_module
from asyncstep.runner import sampled_tokens as sampled_tokens_module
from asyncstep.runner.async_output import AsyncModelRunnerOutput
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.cudagraph_dispatcher import CUDAGraphMode
from asyncstep.runner.cudagraph_runner import CudaGraphRunner, HostInputs, StageOutput
from asyncstep.runner.input_batch import CachedRequestState, InputBatch
from asyncstep.runner.model_runner import ModelRunner
from asyncstep.runner.sampler import SamplingMetadata
from asyncstep.runner.step_inputs import StepInputs

BLOCK = 4
MAX_MODEL_LEN = 64
VOCAB = 500  # tiny-llama's is 512
#: (async scheduling, the engine's steps in flight, persistent batches).
MODES = {"sync": (False, 1, 1), "async": (True, 2, 1), "pipeline": (False, 3, 3)}
#: Sampling settings of request i (seeded: both runners draw the same tokens).
SAMPLING: dict[str, Any] = {
    "greedy": lambda i: {"temperature": 0.0},
    "seeded": lambda i: {"temperature": 0.9, "top_p": 0.8, "top_k": 20, "seed": i},
    "logprobs": lambda i: {"temperature": 0.0, "logprobs": 2},
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- FULL graphs on the CPU ---------------------------------------------------


def _full_stub(self: CudaGraphRunner, mode: CUDAGraphMode, desc: Any, meta: Any) -> StageOutput:
    """A FULL "graph": the torch reference attention cannot run in one, so
    the stage's output is a function of the static inputs it would read."""
    if mode is not CUDAGraphMode.FULL:
        return _real_run(self, mode, desc, meta)
    n = desc.num_tokens
    hidden, _ = self.model.model.begin(self.input_ids[:n], None)
    scale = 1.0 + (self.positions[:n] % 5).unsqueeze(-1) + (self.slot_mapping[:n] % 3).unsqueeze(-1)
    if not self.computes_logits(mode, desc):
        return hidden * scale
    logits = self.model.compute_logits(hidden * scale)  # a uniform decode graph's LM head
    if self.greedy is not None and desc in self.greedy_graphs:  # and its argmax
        return self.greedy.wrap(lambda: logits, n)()
    return logits


_real_run = CudaGraphRunner.run


def _any_mode(name: str, device: torch.device, backend: str, stand_in: bool = False) -> Any:
    return CUDAGraphMode.parse(name) if stand_in else CUDAGraphMode.NONE


# -- two runners in lockstep --------------------------------------------------


@dataclass
class Scenario:
    mode: str
    graphs: str
    max_num_seqs: int
    budget: int
    num_blocks: int
    prefix_caching: bool
    #: (arrival step, prompt, max_tokens, abort step or None[, sampling])
    requests: list[tuple[Any, ...]]
    #: Sampled tokens appended one by one up to this many rows (0: always
    #: at once, so small batches take the large batches' path too).
    few_rows: int = 0
    #: Block tables of up to this many entries are staged whole (0: only the
    #: changed rows, as long contexts are).
    small_table: int = 0
    #: The runners compared: ``fast_paths`` on and off, or (``greedy``) the
    #: graphs' argmax (``greedy_in_graph``) on and off, fast paths on.
    compare: str = "fast_paths"


def make_runner(
    loaded: LoadedModel,
    scenario: Scenario,
    *,
    fast: bool,
    model: Any = None,
    greedy_in_graph: bool = True,
) -> ModelRunner:
    async_scheduling, _, num_batches = MODES[scenario.mode]
    runner = ModelRunner(
        model if model is not None else loaded.model,
        device=loaded.device,
        dtype=loaded.dtype,
        max_model_len=MAX_MODEL_LEN,
        max_num_reqs=scenario.max_num_seqs,
        block_size=BLOCK,
        async_scheduling=async_scheduling,
        compilation=CompilationConfig(
            cudagraph_mode=scenario.graphs,
            attention_backend="torch",
            greedy_in_graph=greedy_in_graph,
        ),
        max_num_batched_tokens=scenario.budget,
        graph_stand_in=scenario.graphs != "NONE",
        num_input_batches=num_batches,
    )
    runner.initialize_kv_cache(scenario.num_blocks)
    runner.capture_model()
    runner.fast_paths = fast
    return runner


def snapshot(runner: ModelRunner, inputs: StepInputs) -> dict[str, Any]:
    """What the step's forward reads (the padded device inputs, and each
    request's block table entries up to its sequence length)."""
    batch = runner.input_batch
    n = batch.num_reqs
    desc = inputs.batch_descriptor
    logits = inputs.logits_indices
    if isinstance(logits, slice):
        logits_list = list(range(logits.start or 0, logits.stop))
    else:
        logits_list = logits.tolist()
    snap: dict[str, Any] = {
        "mode": inputs.cudagraph_mode,
        "desc": desc,
        "req_ids": batch.req_ids,
        "sample_rows": list(inputs.sample_rows),
        "logits_indices": logits_list,
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
    }
    meta = inputs.attn_metadata
    if meta is None:  # FULL: the graph runner's static buffers
        graphs = runner.graph_runner
        assert graphs is not None and desc.num_reqs is not None
        slots, table = graphs.slot_mapping[: desc.num_tokens], graphs.block_table
        qsl = graphs.query_start_loc[: desc.num_reqs + 1]
        seq_lens = graphs.seq_lens[: desc.num_reqs]
    else:
        slots, table = meta.slot_mapping[: len(inputs.input_ids)], meta.block_table
        qsl, seq_lens = meta.query_start_loc, meta.seq_lens
        snap |= {
            "num_actual_tokens": meta.num_actual_tokens,
            "num_decodes": meta.num_decodes,
            "max_query_len": meta.max_query_len,
            "max_seq_len": meta.max_seq_len,
            "qsl_cpu": meta.query_start_loc_cpu.tolist(),
            "seq_lens_cpu": meta.seq_lens_cpu.tolist(),
        }
    lens = seq_lens.tolist()
    snap |= {
        "slots": slots.tolist(),
        "qsl": qsl.tolist(),
        "seq_lens": lens,
        "blocks": [table[r, : cdiv(lens[r], BLOCK)].tolist() for r in range(n)],
    }
    return snap


def batch_state(runner: ModelRunner) -> list[Any]:
    """Every persistent batch's rows (a batch not in this step may still
    hold the holes its finished requests left), and the requests' states."""
    state: list[Any] = []
    for batch in runner.input_batches:
        table = batch.block_table
        rows = []
        for row, req_id in enumerate(batch._req_ids):
            if req_id is None:
                rows.append(None)
                continue
            n, nblocks = int(batch.num_tokens[row]), int(table.num_blocks_per_row[row])
            row_state = batch._states[row]
            assert row_state is not None and row_state.req_id == req_id
            rows.append(
                (
                    req_id,
                    batch.token_ids_cpu[row, :n].tolist(),
                    int(batch.num_computed_tokens_cpu[row]),
                    table.block_table_np[row, :nblocks].tolist(),
                    batch.sampling_params[row],
                )
            )
        state.append(rows)
    requests = {r: (s.output_token_ids, s.block_ids) for r, s in sorted(runner.requests.items())}
    return [state, requests]


class Recorder:
    """Snapshots of the inputs each ``prepare`` returns."""

    def __init__(self, runner: ModelRunner) -> None:
        self.snaps: list[dict[str, Any]] = []
        builder = runner.step_inputs
        prepare = builder.prepare

        def recording(*args: Any, **kwargs: Any) -> StepInputs:
            inputs = prepare(*args, **kwargs)
            self.snaps.append(snapshot(runner, inputs))
            return inputs

        builder.prepare = recording  # type: ignore[method-assign]


def runner_output(out: ModelRunnerOutput | AsyncModelRunnerOutput | None) -> ModelRunnerOutput:
    assert out is not None
    return out.get_output() if isinstance(out, AsyncModelRunnerOutput) else out


def run_lockstep(loaded: LoadedModel, scenario: Scenario) -> int:
    """Drive a fast and a slow runner with the same steps; returns how many
    steps were steady (the same requests in the same rows as the step before)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner_module, "resolve_cudagraph_mode", _any_mode)
        mp.setattr(CudaGraphRunner, "run", _full_stub)
        mp.setattr(sampled_tokens_module, "_FEW_ROWS", scenario.few_rows)
        mp.setattr(cudagraph_runner_module, "_SMALL_BLOCK_TABLE", scenario.small_table)
        return _run_lockstep(loaded, scenario)


def _run_lockstep(loaded: LoadedModel, scenario: Scenario) -> int:
    async_scheduling, depth, _ = MODES[scenario.mode]
    fast = make_runner(loaded, scenario, fast=True)
    model = copy.deepcopy(loaded.model)
    if scenario.compare == "greedy":
        slow = make_runner(loaded, scenario, fast=True, model=model, greedy_in_graph=False)
    else:
        slow = make_runner(loaded, scenario, fast=False, model=model)
    recorders = Recorder(fast), Recorder(slow)
    steady_steps = 0  # steps whose update moved no row
    update_states = fast.batches.update

    def counting(so: SchedulerOutput) -> None:
        nonlocal steady_steps
        batch = fast.input_batch
        version = batch.layout_version
        update_states(so)
        steady_steps += batch.layout_version == version and so.num_reqs > 0

    fast.batches.update = counting  # type: ignore[method-assign]
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=scenario.budget, max_num_seqs=scenario.max_num_seqs),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=scenario.prefix_caching),
        scenario.num_blocks,
        max_model_len=MAX_MODEL_LEN,
        async_scheduling=async_scheduling,
        max_num_running_reqs=scenario.max_num_seqs * (1 if async_scheduling else depth),
    )
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i, (arrive, prompt, max_tokens, abort, *sampling) in enumerate(scenario.requests):
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, **SAMPLING[(*sampling, "greedy")[0]](i)
        )
        arrivals.setdefault(arrive, []).append(Request(f"r{i}", prompt, params))
        if abort is not None:
            aborts.setdefault(arrive + abort, []).append(f"r{i}")
    in_flight: deque[tuple[SchedulerOutput, Any, Any]] = deque()
    for step in itertools.count():
        assert step < 2000, "the scheduler did not finish"
        for request in arrivals.pop(step, []):
            sched.add_request(request)
        sched.finish_requests(aborts.pop(step, []), RequestStatus.FINISHED_ABORTED)
        if not sched.has_requests() and not arrivals and not in_flight:
            break
        if len(in_flight) < depth and (sched.has_work_to_schedule() or not in_flight):
            so = sched.schedule()
            outs = []
            for runner in (fast, slow):
                result = runner.execute_model(so)
                outs.append(runner.sample_tokens() if result is None else result)
            fast_snap, slow_snap = (r.snaps[-1] for r in recorders) if so.num_reqs else ({}, {})
            assert fast_snap == slow_snap, f"step {so.step_id}"
            assert batch_state(fast) == batch_state(slow), f"step {so.step_id}"
            in_flight.append((so, *outs))
            if len(in_flight) < depth:
                continue
        so, fast_out, slow_out = in_flight.popleft()
        got, want = runner_output(fast_out), runner_output(slow_out)
        assert got == want, f"step {so.step_id}"
        sched.update_from_output(so, got)
    return steady_steps


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    base = draw(st.lists(st.integers(3, VOCAB - 1), min_size=24, max_size=24))
    requests = []
    for _ in range(draw(st.integers(1, 7))):
        length = draw(st.integers(1, 24))
        shared = draw(st.booleans())  # a prefix of the same base: prefix-cache hits
        prompt = (
            base[:length]
            if shared
            else draw(st.lists(st.integers(3, VOCAB - 1), min_size=length, max_size=length))
        )
        abort = draw(st.none() | st.integers(0, 30))
        sampling = draw(st.sampled_from(sorted(SAMPLING)))
        requests.append(
            (draw(st.integers(0, 12)), prompt, draw(st.integers(1, 20)), abort, sampling)
        )
    return Scenario(
        mode=draw(st.sampled_from(sorted(MODES))),
        graphs=draw(st.sampled_from(["NONE", "PIECEWISE", "FULL_AND_PIECEWISE"])),
        max_num_seqs=draw(st.integers(1, 6)),
        budget=draw(st.integers(4, 40)),
        num_blocks=draw(st.integers(MAX_MODEL_LEN // BLOCK, 40)),  # small: preemption
        prefix_caching=draw(st.booleans()),
        requests=requests,
        few_rows=draw(st.sampled_from([0, 32])),
        small_table=draw(st.sampled_from([0, 16384])),
    )


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scenario=scenarios())
def test_fast_paths_compute_the_general_paths_inputs(
    tiny_model: LoadedModel, scenario: Scenario
) -> None:
    run_lockstep(tiny_model, scenario)


@pytest.mark.parametrize("few_rows", [0, 32])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("graphs", ["NONE", "FULL_AND_PIECEWISE"])
def test_steady_decode_takes_the_fast_path(
    tiny_model: LoadedModel, mode: str, graphs: str, few_rows: int
) -> None:
    """Requests joining together, preempted on a small cache, chunked, one
    aborted: the same inputs, and most steps are steady."""
    prompts = [[(7 * i + 3 * j) % VOCAB + 3 for j in range(5 + 3 * i)] for i in range(5)]
    scenario = Scenario(
        mode=mode,
        graphs=graphs,
        max_num_seqs=5,
        budget=16,
        num_blocks=20,
        prefix_caching=False,
        requests=[
            (0, p, 24, 20 if i == 2 else None, ("greedy", "seeded", "greedy", "logprobs")[i % 4])
            for i, p in enumerate(prompts)
        ],
        few_rows=few_rows,
    )
    assert run_lockstep(tiny_model, scenario) > 20


# -- the pieces ----------------------------------------------------------------


def test_decode_slot_mapping_equals_the_general_one() -> None:
    table = BlockTable(max_num_reqs=3, max_num_blocks_per_req=4, block_size=4)
    table.add_row([7, 2], 0)
    table.add_row([5, 1, 3], 1)
    table.add_row([9], 2)
    positions = np.array([5, 9, 0])
    want = table.compute_slot_mapping(np.arange(3), positions)
    assert table.decode_slot_mapping(positions).tolist() == want.tolist() == [9, 13, 36]
    # Several KV cache groups (block ids interleaved): every group's at once.
    groups = BlockTable(max_num_reqs=3, max_num_blocks_per_req=4, block_size=4, num_groups=3)
    for row, ids in enumerate([[7, 8, 9, 2, 3, 4], [5, 6, 7, 1, 2, 3, 3, 4, 5], [9, 10, 11]]):
        groups.add_row(ids, row)
    each = [groups.compute_slot_mapping(np.arange(3), positions, g).tolist() for g in (1, 2)]
    assert groups.decode_group_slot_mappings(positions).tolist() == each
    assert each[0] == [3 * 4 + 1, 4 * 4 + 1, 10 * 4]


def test_block_table_marks_changed_rows() -> None:
    table = BlockTable(max_num_reqs=4, max_num_blocks_per_req=4, block_size=4)
    table.add_row([1], 0)
    table.add_row([2], 1)
    assert table.take_dirty_rows(4) == [0, 1]
    assert table.take_dirty_rows(4) == []
    table.append_row([], 0)  # no new block: unchanged
    table.append_row([3], 1)
    table.move_row(1, 3)
    assert table.take_dirty_rows(4) == [1, 3]
    table.swap_row(0, 2)
    assert table.take_dirty_rows(2) == [0]  # row 2 is past the rows asked for
    assert table.take_dirty_rows(4) == []


def test_staged_block_table_rewrites_only_changed_rows(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cudagraph_runner_module, "_SMALL_BLOCK_TABLE", 0)  # a "long context"
    scenario = Scenario("sync", "PIECEWISE", 4, 64, 32, False, [])
    runner = make_runner(tiny_model, scenario, fast=True)
    graphs = runner.graph_runner
    assert graphs is not None
    staged = graphs.inputs.host["block_table"]
    batch = runner.input_batch
    for i in range(3):
        batch.add_request(
            CachedRequestState(f"r{i}", [1, 2, 3], SamplingParams(), None, [i, 10 + i], 3)
        )
    table = batch.block_table

    def stage() -> None:
        host = runner.step_inputs._decode_host_inputs()
        graphs._stage_block_table(host)

    stage()  # first time: every row, up to the most blocks a row has
    assert staged[:3, :2].tolist() == [[0, 10], [1, 11], [2, 12]]
    staged[:3, :2] = -1  # what is not rewritten stays
    table.append_row([20], 1)
    stage()
    assert staged[:3, :3].tolist() == [[-1, -1, 0], [1, 11, 20], [-1, -1, 0]]
    # Another table staged in between: the next step of the first restages all.
    other = BlockTable(4, table.max_num_blocks_per_req, BLOCK)
    other.add_row([30], 0)
    zeros = np.zeros(1, dtype=np.int64)
    graphs._stage_block_table(
        HostInputs(
            input_ids=zeros,
            positions=zeros,
            slot_mapping=zeros,
            query_start_loc=np.arange(2, dtype=np.int32),
            seq_lens=np.ones(1, dtype=np.int32),
            block_table=other.block_table_np[:1],
            block_table_source=other,
        )
    )
    assert staged[0, :1].tolist() == [30]
    stage()
    assert staged[:3, :3].tolist() == [[0, 10, 0], [1, 11, 20], [2, 12, 0]]


def test_layout_version_and_sampling_metadata_cache() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4, device=torch.device("cpu"))
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.5)
    for rid, params in (("a", greedy), ("b", hot)):
        batch.add_request(CachedRequestState(rid, [1, 2], params, None, [0], 2))
    first = batch.sampling_metadata([0, 1])
    assert batch.sampling_metadata([0, 1]) is first  # same rows, same requests
    assert batch.sampling_metadata([1]) is not first
    version = batch.layout_version
    batch.append_token(0, 5)
    batch.block_table.append_row([3], 1)
    assert batch.layout_version == version  # contents, not rows
    batch.swap_states(0, 1)
    assert batch.layout_version > version
    swapped = batch.sampling_metadata([0, 1])
    assert swapped is not first and swapped.top_p is not None
    assert swapped.top_p.tolist() == [0.5, 1.0]
    batch.remove_request("a")
    batch.condense()
    assert batch.req_ids == ["b"] and [s.req_id for s in batch.states] == ["b"]
    # Only plain greedy requests left: one metadata for any rows, from_params' own.
    batch.remove_request("b")
    for rid in "cd":
        batch.add_request(CachedRequestState(rid, [1], greedy, None, [0], 1))
    batch.condense()
    want = SamplingMetadata.from_params([greedy, greedy], {}, torch.device("cpu"))
    assert batch.sampling_metadata([0, 1]) == want == batch.sampling_metadata([1])
    batch.add_request(CachedRequestState("e", [1], SamplingParams(logprobs=2), None, [0], 1))
    assert batch.sampling_metadata([0, 1, 2]).max_num_logprobs == 2


def test_append_tokens_equals_append_token() -> None:
    def make() -> InputBatch:
        batch = InputBatch(
            max_num_reqs=3, max_model_len=8, block_size=4, device=torch.device("cpu")
        )
        for i in range(3):
            batch.add_request(
                CachedRequestState(f"r{i}", [1] * (i + 1), SamplingParams(), None, [], 0)
            )
        return batch

    one, many, some = make(), make(), make()
    for row, token in enumerate([7, 8, 9]):
        one.append_token(row, token)
    many.append_tokens(None, np.array([7, 8, 9]))
    some.append_tokens(np.array([2, 0, 1]), np.array([9, 7, 8]))
    for batch in (many, some):
        assert batch.token_ids_cpu.tolist() == one.token_ids_cpu.tolist()
        assert batch.num_tokens.tolist() == one.num_tokens.tolist() == [2, 3, 4]
    full = make()
    full.num_tokens[1] = 8
    with pytest.raises(IndexError):
        full.append_tokens(None, np.array([1, 2, 3]))


def _cuts_reference(sorted_lens: np.ndarray, max_buckets: int, min_bucket: int) -> list[int]:
    """The decode plan's cuts as first written (a loop per candidate cut)."""
    n = len(sorted_lens)
    cuts = [0, n]
    while len(cuts) - 1 < max_buckets:
        best, best_gain = None, 0
        for i in range(len(cuts) - 1):
            lo, hi = cuts[i], cuts[i + 1]
            for c in range(lo + min_bucket, hi - min_bucket + 1):
                gain = (c - lo) * int(sorted_lens[hi - 1] - sorted_lens[c - 1])
                if gain > best_gain:
                    best, best_gain = c, gain
        if best is None:
            return cuts
        cuts = sorted([*cuts, best])
    return cuts


@settings(max_examples=300, deadline=None)
@given(
    lens=st.lists(st.integers(1, 300), max_size=80),
    max_buckets=st.integers(1, 5),
    min_bucket=st.integers(1, 6),
)
def test_decode_bucket_cuts_equal_the_loop(
    lens: list[int], max_buckets: int, min_bucket: int
) -> None:
    sorted_lens = np.sort(np.array(lens, dtype=np.int32))
    assert _cuts(sorted_lens, max_buckets, min_bucket) == _cuts_reference(
        sorted_lens, max_buckets, min_bucket
    )


def _reorder_reference(batch: InputBatch, num_scheduled_tokens: dict[str, int]) -> int:
    """``reorder_decodes_first`` as first written (a scan from both ends)."""
    ids = batch.req_ids
    is_decode = [num_scheduled_tokens[r] == 1 for r in ids]
    num_decodes = sum(is_decode)
    front, back = 0, len(ids) - 1
    while True:
        while front < len(ids) and is_decode[front]:
            front += 1
        while back >= 0 and not is_decode[back]:
            back -= 1
        if front >= num_decodes or back < num_decodes:
            return num_decodes
        batch.swap_states(front, back)
        is_decode[front], is_decode[back] = True, False


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(1, 3), max_size=12))
def test_reorder_decodes_first_equals_the_scan(counts: list[int]) -> None:
    def make() -> InputBatch:
        batch = InputBatch(
            max_num_reqs=12, max_model_len=8, block_size=4, device=torch.device("cpu")
        )
        for i in range(len(counts)):
            state = CachedRequestState(f"r{i}", [i + 1], SamplingParams(), None, [i], 0)
            batch.add_request(state)
        return batch

    scheduled = {f"r{i}": n for i, n in enumerate(counts)}
    got, want = make(), make()
    assert got.reorder_decodes_first(scheduled) == _reorder_reference(want, scheduled)
    assert got.req_ids == want.req_ids
    assert got.token_ids_cpu.tolist() == want.token_ids_cpu.tolist()
    assert got.block_table.block_table_np.tolist() == want.block_table.block_table_np.tolist()


@pytest.mark.parametrize("fast", [True, False])
def test_a_token_never_sampled_is_an_error(tiny_model: LoadedModel, fast: bool) -> None:
    runner = make_runner(tiny_model, Scenario("async", "NONE", 4, 64, 32, False, []), fast=fast)
    greedy = SamplingParams(temperature=0.0)
    first = SchedulerOutput(
        1, [NewRequestData("a", [1, 2, 3], greedy, [0], 0)], CachedRequestData(), {"a": 3}, 3
    )
    assert runner.execute_model(first) is None
    runner.sample_tokens()
    # "b" computes its 3rd token, which no step sampled.
    cached = CachedRequestData(["a"], [False], [[]], [[]], [3])
    second = SchedulerOutput(
        2, [NewRequestData("b", [4, 5], greedy, [1], 2)], cached, {"a": 1, "b": 1}, 2
    )
    with pytest.raises(RuntimeError, match=r"never sampled \(requests \['b'\]\)"):
        runner.execute_model(second)
