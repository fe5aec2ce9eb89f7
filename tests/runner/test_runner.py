"""The model runner's contract (vLLM v1): two-phase steps, the re-entry
error, empty steps, and the persistent batch's bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncstep.datatypes import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from asyncstep.models.model_loader import LoadedModel
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.input_batch import CachedRequestState, InputBatch
from asyncstep.runner.model_runner import REENTRY_ERROR, ModelRunner

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def make_runner(
    loaded: LoadedModel, num_blocks: int = 64, num_input_batches: int = 1
) -> ModelRunner:
    runner = ModelRunner(
        loaded.model,
        device=loaded.device,
        dtype=loaded.dtype,
        max_model_len=128,
        max_num_reqs=8,
        block_size=BLOCK,
        num_input_batches=num_input_batches,
    )
    runner.initialize_kv_cache(num_blocks)
    return runner


def new_req(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, prompt, GREEDY, blocks, computed)


def step(
    step_id: int,
    new: list[NewRequestData] = (),  # type: ignore[assignment]
    cached: CachedRequestData | None = None,
    tokens: dict[str, int] | None = None,
    finished: list[str] = (),  # type: ignore[assignment]
) -> SchedulerOutput:
    tokens = tokens or {}
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData(),
        num_scheduled_tokens=tokens,
        total_num_scheduled_tokens=sum(tokens.values()),
        finished_req_ids=list(finished),
    )


def decode(req_ids: list[str], computed: list[int], new_blocks: list[list[int]] | None = None):
    return CachedRequestData(
        req_ids=req_ids,
        resumed_from_preemption=[False] * len(req_ids),
        new_token_ids=[[] for _ in req_ids],
        new_block_ids=new_blocks or [[] for _ in req_ids],
        num_computed_tokens=computed,
    )


def test_two_phase_step_and_reentry_error(tiny_model: LoadedModel) -> None:
    runner = make_runner(tiny_model)
    first = step(1, [new_req("a", [1, 2, 3], [0])], tokens={"a": 3})
    assert runner.execute_model(first) is None
    with pytest.raises(RuntimeError) as err:
        runner.execute_model(step(2, cached=decode(["a"], [3]), tokens={"a": 1}))
    assert str(err.value) == REENTRY_ERROR
    out = runner.sample_tokens()
    assert out.req_ids == ["a"] and len(out.sampled_token_ids[0]) == 1
    # Now the next step may run; sample_tokens without a pending step is misuse.
    assert runner.execute_model(step(2, cached=decode(["a"], [3]), tokens={"a": 1})) is None
    runner.sample_tokens()
    with pytest.raises(RuntimeError, match="without a pending execute_model"):
        runner.sample_tokens()


def test_empty_step_runs_no_forward(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(tiny_model)
    runner.execute_model(step(1, [new_req("a", [1, 2, 3], [0])], tokens={"a": 3}))
    runner.sample_tokens()
    calls = []
    monkeypatch.setattr(runner.model, "forward", lambda *a, **k: calls.append(a))
    # The request ended: the step carries only its id, and no tokens.
    out = runner.execute_model(step(2, finished=["a"]))
    assert out is EMPTY_MODEL_RUNNER_OUTPUT
    assert calls == []
    assert runner.execute_model_state is None
    assert "a" not in runner.requests and runner.input_batch.num_reqs == 0


def run_greedy(runner: ModelRunner, prompt: list[int], chunk: int, n_out: int) -> list[int]:
    """Drive one request through prefill chunks of ``chunk`` tokens, then decodes."""
    blocks = list(range(-(-(len(prompt) + n_out) // BLOCK)))
    computed, out, step_id = 0, [], 0
    while len(out) < n_out:
        todo = min(chunk, len(prompt) + len(out) - computed)
        step_id += 1
        if computed == 0:
            so = step(step_id, [new_req("r", prompt, blocks)], tokens={"r": todo})
        else:
            so = step(step_id, cached=decode(["r"], [computed]), tokens={"r": todo})
        assert runner.execute_model(so) is None
        sampled = runner.sample_tokens().sampled_token_ids[0]
        computed += todo
        if computed < len(prompt):
            assert sampled == []  # a prompt chunk that is not the last samples nothing
        out += sampled
    return out


def test_chunked_prefill_gives_the_same_tokens(tiny_model: LoadedModel) -> None:
    prompt = [5, 9, 2, 33, 7, 100, 41, 8, 12, 60, 3]
    whole = run_greedy(make_runner(tiny_model), prompt, chunk=64, n_out=6)
    chunked = run_greedy(make_runner(tiny_model), prompt, chunk=3, n_out=6)
    assert whole == chunked


def test_batched_requests_match_alone(tiny_model: LoadedModel) -> None:
    """Two requests in one batch (one decoding while the other prefills)
    sample what each samples alone."""
    alone_a = run_greedy(make_runner(tiny_model), [4, 8, 15, 16], chunk=64, n_out=3)
    alone_b = run_greedy(make_runner(tiny_model), [23, 42, 7, 1, 99, 3, 5], chunk=64, n_out=2)
    runner = make_runner(tiny_model)
    runner.execute_model(step(1, [new_req("a", [4, 8, 15, 16], [0, 1])], tokens={"a": 4}))
    a = runner.sample_tokens().sampled_token_ids[0]
    so = step(
        2,
        [new_req("b", [23, 42, 7, 1, 99, 3, 5], [2, 3])],
        cached=decode(["a"], [4]),
        tokens={"b": 7, "a": 1},
    )
    runner.execute_model(so)
    out = runner.sample_tokens()
    a += out.sampled_token_ids[out.req_id_to_index["a"]]
    b = out.sampled_token_ids[out.req_id_to_index["b"]]
    runner.execute_model(step(3, cached=decode(["b", "a"], [7, 5]), tokens={"a": 1, "b": 1}))
    out = runner.sample_tokens()
    a += out.sampled_token_ids[out.req_id_to_index["a"]]
    b += out.sampled_token_ids[out.req_id_to_index["b"]]
    assert a == alone_a and b == alone_b


def test_resumed_request_replaces_its_blocks(tiny_model: LoadedModel) -> None:
    runner = make_runner(tiny_model)
    runner.execute_model(step(1, [new_req("a", [1, 2, 3, 4, 5], [7, 8])], tokens={"a": 5}))
    token = runner.sample_tokens().sampled_token_ids[0]
    # Preempted: not scheduled in step 2 (it leaves the batch, its state stays).
    runner.execute_model(step(2))
    assert runner.input_batch.num_reqs == 0 and "a" in runner.requests
    resumed = CachedRequestData(["a"], [True], [[]], [[3, 4]], [0])
    runner.execute_model(step(3, cached=resumed, tokens={"a": 6}))
    row = runner.input_batch.req_id_to_index["a"]
    assert runner.input_batch.block_table.block_table_np[row, :2].tolist() == [3, 4]
    assert runner.input_batch.token_ids_cpu[row, :6].tolist() == [1, 2, 3, 4, 5, *token]
    runner.sample_tokens()


def alternating_steps(runner: ModelRunner) -> list[dict[str, list[int]]]:
    """Pipeline-style steps: two request sets in turn (a, b; then c, d),
    each prefilled once and decoded twice. Returns each step's tokens."""
    prompts = {"a": [1, 2, 3], "b": [4, 5], "c": [6, 7, 8, 9], "d": [10]}
    blocks = {"a": [0, 1], "b": [2, 3], "c": [4, 5], "d": [6, 7]}
    sets = [["a", "b"], ["c", "d"]]
    computed = {r: 0 for r in prompts}
    sampled: list[dict[str, list[int]]] = []
    for i in range(6):
        ids = sets[i % 2]
        if i < 2:
            so = step(
                i,
                [new_req(r, prompts[r], blocks[r]) for r in ids],
                tokens={r: len(prompts[r]) for r in ids},
            )
        else:
            so = step(
                i, cached=decode(ids, [computed[r] for r in ids]), tokens=dict.fromkeys(ids, 1)
            )
        for r in ids:
            computed[r] += so.num_scheduled_tokens[r]
        assert runner.execute_model(so) is None
        out = runner.sample_tokens()
        sampled.append(dict(zip(out.req_ids, out.sampled_token_ids, strict=True)))
    return sampled


def test_one_persistent_batch_per_step_in_flight(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = alternating_steps(make_runner(tiny_model))
    runner = make_runner(tiny_model, num_input_batches=2)
    added: list[str] = []
    real_add = InputBatch.add_request

    def counting_add(self: InputBatch, req: CachedRequestState) -> int:
        added.append(req.req_id)
        return real_add(self, req)

    monkeypatch.setattr(InputBatch, "add_request", counting_add)
    assert alternating_steps(runner) == want
    # Each request joined a batch once: alternating steps rebuilt no rows.
    assert sorted(added) == ["a", "b", "c", "d"]
    first, second = runner.input_batches
    assert {frozenset(first.req_id_to_index), frozenset(second.req_id_to_index)} == {
        frozenset("ab"),
        frozenset("cd"),
    }


def test_num_input_batches_must_be_positive(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="num_input_batches must be >= 1"):
        make_runner(tiny_model, num_input_batches=0)


def test_slot_mapping_from_block_table() -> None:
    table = BlockTable(max_num_reqs=2, max_num_blocks_per_req=4, block_size=4)
    table.add_row([7, 2], 0)
    table.add_row([5], 1)
    table.append_row([9], 1)
    slots = table.compute_slot_mapping(np.array([0, 0, 0, 1, 1]), np.array([2, 3, 4, 3, 4]))
    assert slots.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 5 * 4 + 3, 9 * 4 + 0]


def test_input_batch_condense_and_decode_first_order() -> None:
    batch = InputBatch(max_num_reqs=4, max_model_len=16, block_size=4, device=torch.device("cpu"))
    for i, rid in enumerate("abcd"):
        batch.add_request(
            CachedRequestState(rid, [i + 1] * (i + 1), GREEDY, None, [i], num_computed_tokens=0)
        )
    batch.remove_request("b")
    batch.condense()
    assert batch.req_ids == ["a", "d", "c"]
    row_d = batch.req_id_to_index["d"]
    assert batch.token_ids_cpu[row_d, :4].tolist() == [4, 4, 4, 4]
    assert batch.block_table.block_table_np[row_d, 0] == 3
    num_decodes = batch.reorder_decodes_first({"a": 3, "d": 1, "c": 1})
    assert num_decodes == 2 and set(batch.req_ids[:2]) == {"c", "d"}
    for rid, n in (("a", 1), ("c", 3), ("d", 4)):
        assert batch.num_tokens[batch.req_id_to_index[rid]] == n
