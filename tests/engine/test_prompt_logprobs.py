"""``SamplingParams.prompt_logprobs`` (vLLM's): every prompt position's
log-prob of the prompt token and the top-k there, from the raw logits.

Against HF transformers on the same weights (fp32, CPU): the embedded
SmolLM2, whole prompts and prompts in chunks (overlap on and off); a prompt
whose blocks are cached still gets every position; ``n`` choices carry the
first choice's; a stream's first chunk carries them. A tiny checkpoint with
large weights (far from ties) through the engine-core process with
preemptions, through (stand-in) piecewise CUDA graphs, and through two
pipeline stages. The runner's tracker reads
hidden states or a graph's logits alike and owes each position once; the
scheduler skips the prefix cache for such a request and reports a prompt
chunk's log-probs alone; bad values are refused; the CLI's flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import asyncstep
from asyncstep import SamplingParams
from asyncstep.datatypes import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncstep.engine.core.scheduler import PROMPT_LOGPROBS_TOKEN_COST
from asyncstep.engine.messages.outputs import Completion
from asyncstep.errors import InvalidRequestError
from asyncstep.models.model_loader import LoadedModel
from asyncstep.runner.input_batch import CachedRequestState, InputBatch
from asyncstep.runner.prompt_logprobs import PromptLogprobsTracker
from tests.engine.test_penalties import smol_prompt
from tests.engine.test_scheduler import FakeRunner, drive, make_request, make_scheduler, prompt_of

CPU = torch.device("cpu")
#: Values against HF (fp32; attention split differently over chunks).
ATOL = 1e-4


def reference(model: Any, prompt: list[int]) -> torch.Tensor:
    """HF's log-softmax of every position's logits, in float32: row ``p - 1``
    predicts prompt position ``p``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return logits.float().log_softmax(-1)


def assert_matches(
    got: list[Logprobs | None] | None, prompt: list[int], ref: torch.Tensor, k: int
) -> None:
    """One entry per prompt token, None first; the prompt token's log-prob
    and rank, then the top ``k`` ids and values, as ``ref`` has them."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        entry, row = got[p], ref[p - 1]
        assert entry is not None
        token = prompt[p]
        assert len(entry.token_ids) == len(entry.logprobs) == k + 1
        assert entry.token_ids[0] == token
        top = row.topk(k)
        assert entry.token_ids[1:] == top.indices.tolist(), p
        want = torch.cat([row[token : token + 1], top.values])
        torch.testing.assert_close(torch.tensor(entry.logprobs), want, rtol=0, atol=ATOL)
        # The rank, up to tokens within the tolerance of the prompt token's value.
        value = float(row[token])
        assert (row > value + ATOL).sum() + 1 <= entry.sampled_token_rank
        assert entry.sampled_token_rank <= (row > value - ATOL).sum() + 1


def assert_same(a: list[Logprobs | None] | None, b: list[Logprobs | None] | None) -> None:
    assert a is not None and b is not None and len(a) == len(b)
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x is not None and y is not None
        assert x.token_ids == y.token_ids and x.sampled_token_rank == y.sampled_token_rank
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0
        )


async def generate_all(
    engine: asyncstep.Engine, requests: list[tuple[Any, SamplingParams]]
) -> list[Completion]:
    """Serve the requests at once; their completions in order."""
    results: list[Any] = [None] * len(requests)

    async def one(i: int) -> None:
        results[i] = await engine.generate(*requests[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(requests)):
            tg.start_soon(one, i)
    return results


# ---------------------------------------------------------------------------
# SmolLM2 against HF.

TEXT = "The capital of France is Paris, and the capital of Germany is Berlin."


@pytest.fixture(scope="module")
def smol(smollm2: LoadedModel, hf_smollm2: Any) -> dict[str, Any]:
    """Two prompts (a chat turn, a text) and HF's log-probs of each."""
    tokenizer = smollm2.tokenizer
    assert tokenizer is not None
    chat = smol_prompt(smollm2, "What is the capital of France?")
    text = list(tokenizer(TEXT).input_ids)
    return {
        "chat": chat,
        "text": text,
        "ref_chat": reference(hf_smollm2, chat),
        "ref_text": reference(hf_smollm2, text),
    }


def greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=3, **kwargs)


@pytest.mark.trio
async def test_smollm2_equals_hf_whole_and_in_chunks(
    smollm2: LoadedModel, smol: dict[str, Any]
) -> None:
    requests = [
        (smol["chat"], greedy(prompt_logprobs=5)),
        (smol["text"], greedy(prompt_logprobs=0)),
        (smol["text"], greedy()),  # beside them, asking for none
    ]
    runs = []
    # Whole prompts; then chunks of 8 tokens over several steps, overlap on and off.
    for budget, overlap in ((2048, True), (8, True), (8, False)):
        async with asyncstep.open_engine(
            smollm2, async_scheduling=overlap, max_num_batched_tokens=budget
        ) as engine:
            runs.append(await generate_all(engine, requests))
    whole = runs[0]
    assert_matches(whole[0].prompt_logprobs, smol["chat"], smol["ref_chat"], 5)
    assert_matches(whole[1].prompt_logprobs, smol["text"], smol["ref_text"], 0)
    assert whole[2].prompt_logprobs is None and whole[2].token_ids == whole[1].token_ids
    for chunked in runs[1:]:
        assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
        for i in (0, 1):
            assert_same(chunked[i].prompt_logprobs, whole[i].prompt_logprobs)
        assert chunked[2].prompt_logprobs is None


@pytest.mark.trio
async def test_cached_prompt_n_choices_and_stream(
    smollm2: LoadedModel, smol: dict[str, Any]
) -> None:
    chat, ref = smol["chat"], smol["ref_chat"]
    async with asyncstep.open_engine(smollm2, block_size=16) as engine:
        await engine.generate(chat, greedy())  # its full blocks are cached now
        hits = engine.statistics().prefix_cache_hit_rate
        cached = await engine.generate(chat, greedy(prompt_logprobs=2))
        assert engine.statistics().prefix_cache_hit_rate == hits  # not looked up
        assert_matches(cached.prompt_logprobs, chat, ref, 2)
        # n choices: the first's log-probs; the others still hit the prefix cache.
        sampled = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=3, prompt_logprobs=1)
        choices = await engine.generate(chat, sampled)
        assert len(choices.outputs) == 3
        assert engine.statistics().prefix_cache_hit_rate > hits
        assert_matches(choices.prompt_logprobs, chat, ref, 1)
        chunks = [c async for c in engine.stream(smol["text"], greedy(prompt_logprobs=1))]
    assert_matches(chunks[0].prompt_logprobs, smol["text"], smol["ref_text"], 1)
    assert len(chunks) > 1 and all(c.prompt_logprobs is None for c in chunks[1:])


# ---------------------------------------------------------------------------
# A tiny checkpoint with large weights: the core process, preemption, a pipeline.

PROMPTS = [list(range(40, 80)), [7, 3] * 9, [200, 3, 99, 14, 8, 61, 1, 2, 3]]
TINY_K = [3, 0, 20]
#: Small steps (prompts in chunks) and a cache of 20 blocks of 4 tokens.
TINY_ENGINE: dict[str, Any] = dict(
    device="cpu", dtype="float32", max_num_batched_tokens=16, block_size=4, num_blocks=20
)


@pytest.fixture(scope="module")
def peaked(peaked_llama_checkpoint: tuple[Path, Any]) -> tuple[Path, Any]:
    """The shared tiny Llama far from ties (conftest), and HF's model of it."""
    return peaked_llama_checkpoint


def tiny_requests() -> list[tuple[Any, SamplingParams]]:
    return [
        (prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=k))
        for prompt, k in zip(PROMPTS, TINY_K, strict=True)
    ]


@pytest.mark.trio
async def test_core_process_with_preemptions_equals_hf(peaked: tuple[Path, Any]) -> None:
    path, model = peaked
    async with asyncstep.open_engine(path, engine_process=True, **TINY_ENGINE) as engine:
        got = await generate_all(engine, tiny_requests())
        assert engine.statistics().num_preemptions > 0  # recomputed prompts: none twice
    for out, prompt, k in zip(got, PROMPTS, TINY_K, strict=True):
        assert_matches(out.prompt_logprobs, prompt, reference(model, prompt), k)


@pytest.mark.trio
async def test_the_last_pipeline_stage_computes_them(peaked: tuple[Path, Any]) -> None:
    path, model = peaked
    options = TINY_ENGINE | {"num_blocks": 64}
    async with asyncstep.open_engine(
        path, pipeline_parallel_size=2, engine_process=False, **options
    ) as engine:
        got = await generate_all(engine, tiny_requests())
    for out, prompt, k in zip(got, PROMPTS, TINY_K, strict=True):
        assert_matches(out.prompt_logprobs, prompt, reference(model, prompt), k)


@pytest.mark.trio
async def test_piecewise_graphs_give_them_from_their_hidden_states(
    peaked: tuple[Path, Any],
) -> None:
    path, model = peaked
    options = TINY_ENGINE | {"num_blocks": 64, "max_num_seqs": 4}
    async with asyncstep.open_engine(
        path,
        cudagraph_mode="PIECEWISE",
        cudagraph_stand_in=True,
        cudagraph_capture_sizes=[1, 2, 4, 8, 16],
        engine_process=False,
        **options,
    ) as engine:
        got = await generate_all(engine, tiny_requests())
        runner = engine.core.executor.runner  # type: ignore[attr-defined]
        assert runner.step_inputs.cudagraph_steps.keys() == {"PIECEWISE"}
    for out, prompt, k in zip(got, PROMPTS, TINY_K, strict=True):
        assert_matches(out.prompt_logprobs, prompt, reference(model, prompt), k)


# ---------------------------------------------------------------------------
# The runner's tracker.


def test_tracker_reads_hidden_states_or_logits_and_owes_each_position_once() -> None:
    hidden_size, vocab = 8, 13
    head = torch.randn(vocab, hidden_size)

    def to_logits(h: torch.Tensor) -> torch.Tensor:
        return h @ head.T

    prompt = [1, 5, 2, 7, 3, 9, 4]  # 7 tokens: positions 1..6 are owed
    batch = InputBatch(max_num_reqs=4, max_model_len=32, block_size=4, device=CPU)
    batch.add_request(CachedRequestState("d", [3, 3], SamplingParams(), None, [], 2))  # decoding
    batch.add_request(
        CachedRequestState("a", prompt, SamplingParams(prompt_logprobs=2), None, [], 0)
    )
    trackers = [PromptLogprobsTracker(vocab), PromptLogprobsTracker(vocab)]
    new = NewRequestData("a", prompt, SamplingParams(prompt_logprobs=2), [], 0)

    def step(computed: int, count: int, owed: range, first: bool = False) -> None:
        """Request "a" computes ``count`` tokens from ``computed``, after "d"'s
        one; the prompt positions ``owed`` come back, from either input."""
        so = SchedulerOutput(
            0, [new] if first else [], CachedRequestData(), {"d": 1, "a": count}, count + 1
        )
        batch.num_computed_tokens_cpu[1] = computed
        hidden = torch.randn(count + 1 + 3, hidden_size)  # 3 padding tokens
        results = []
        for tracker, logits in zip(trackers, (False, True), strict=True):
            tracker.update(so)
            out = to_logits(hidden) if logits else hidden
            found = tracker.compute(so, batch, out, None if logits else to_logits, None)
            results.append(found.to_lists() if found is not None else {})
        by_hidden, by_logits = results
        if not owed:
            assert by_hidden == by_logits == {}
            return
        assert by_hidden.keys() == {"a"} and len(by_hidden["a"]) == len(owed)
        assert_same([None, *by_logits["a"]], [None, *by_hidden["a"]])
        expected = to_logits(hidden).log_softmax(-1)
        for p, entry in zip(owed, by_hidden["a"], strict=True):
            row = expected[1 + p - 1 - computed]  # "a"'s tokens follow "d"'s
            assert entry.token_ids[0] == prompt[p] and len(entry.token_ids) == 3
            assert entry.logprobs[0] == pytest.approx(float(row[prompt[p]]), abs=1e-5)
            assert entry.token_ids[1:] == row.topk(2).indices.tolist()

    step(0, 3, range(1, 4), first=True)
    # Preempted and recomputed from 0: positions 1..3 are not owed again, 4..6 are.
    step(0, 6, range(4, 7))
    assert all(not t.owed for t in trackers)  # owes nothing more: steps cost nothing
    step(6, 1, range(0))


# ---------------------------------------------------------------------------
# The scheduler, the checks, the command line.


def test_scheduler_skips_the_prefix_cache_and_reports_chunks() -> None:
    sched = make_scheduler(block_size=4, budget=12)
    prompt = list(range(10, 22))  # 12 tokens: 2 full blocks may hit (the last one computes)
    drive(sched, FakeRunner(4), {0: [make_request("plain", prompt)]})
    sched.add_request(make_request("hits", prompt))
    sched.add_request(make_request("asks", prompt, prompt_logprobs=2))
    so = sched.schedule()
    computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    assert computed == {"hits": 8, "asks": 0}
    # "asks": a chunk, its rows at PROMPT_LOGPROBS_TOKEN_COST each
    assert so.num_scheduled_tokens == {"hits": 4, "asks": 8 // PROMPT_LOGPROBS_TOKEN_COST}
    chunk = [
        Logprobs([prompt[p], 1, 2], [-1.0, -0.5, -0.7], 3)
        for p in range(1, 1 + 8 // PROMPT_LOGPROBS_TOKEN_COST)
    ]
    output = ModelRunnerOutput(
        ["hits", "asks"], {"hits": 0, "asks": 1}, [[5], []], prompt_logprobs={"asks": chunk}
    )
    news = sched.update_from_output(so, output)
    assert news["hits"].new_token_ids == [5] and news["hits"].new_prompt_logprobs is None
    assert news["asks"].new_token_ids == [] and news["asks"].new_prompt_logprobs == chunk
    assert not news["asks"].finished


def test_a_prompt_that_asks_takes_more_of_the_step_budget() -> None:
    """Each of its prompt rows takes PROMPT_LOGPROBS_TOKEN_COST of the token
    budget (the LM head's row, its log-softmax, rank and top-k over the
    vocabulary), so a step with such a prompt does the work its budget was set
    for and a neighbour beside it keeps its pace; its last prompt token (which
    samples) and its decodes take one."""
    cost = PROMPT_LOGPROBS_TOKEN_COST
    sched = make_scheduler(block_size=4, budget=12 * cost, num_blocks=64)
    asks = make_request("asks", prompt_of(1, 40), max_tokens=3, prompt_logprobs=5)
    plain = make_request("plain", prompt_of(2, 40), max_tokens=3)
    run = drive(sched, FakeRunner(4), {0: [asks, plain]})
    scheduled = [so.num_scheduled_tokens for so in run.outputs]
    # 12 prompt rows a step (the whole budget: "plain" waits), then the last
    # three rows and the sampling token (3 x cost + 1) beside "plain"'s chunk.
    assert [s.get("asks") for s in scheduled[:4]] == [12, 12, 12, 4]
    assert scheduled[3]["plain"] == 12 * cost - (3 * cost + 1)
    assert all(s.get("asks", 1) == 1 for s in scheduled[4:])
    assert run.tokens["asks"] and len(run.tokens["asks"]) == 3


@pytest.mark.parametrize("value", [-1, 21, 1.5, "2", True, 2**70])
def test_bad_values_are_refused(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_cli_flag_and_json(capsys: pytest.CaptureFixture[str], tiny_hf_dir: Path) -> None:
    from asyncstep.cli import main

    args = ["generate", "--model", str(tiny_hf_dir), "--no-chat", "--no-engine-process"]
    code = main([*args, "--max-tokens", "1", "--prompt-logprobs", "2", "--json", "Hello there"])
    out, err = capsys.readouterr()
    assert code == 0, err
    record = json.loads(out)
    prompt_logprobs = record["prompt_logprobs"]
    assert len(prompt_logprobs) == len(record["prompt_token_ids"]) > 1
    assert prompt_logprobs[0] is None
    assert all(len(entry["token_ids"]) == 3 for entry in prompt_logprobs[1:])
