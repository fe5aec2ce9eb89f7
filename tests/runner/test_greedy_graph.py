"""Greedy sampling inside the FULL decode graph (``greedy_in_graph``,
:mod:`asyncstep.runner.greedy_graph`): the graph's argmax is the sampler's,
ties included; a runner with it on gives the tokens and log-probs of one
with it off, step by step, through mixed batches (greedy and sampled
requests, a request with log-probs joining, requests finishing, aborted,
preempted), synchronous, async and pipelined; a step with a grammar
bitmask samples the masked logits; and the engine on the Triton kernels
(interpreted on the CPU, the graphs' stand-in) the same tokens."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
import torch

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import CacheConfig, SchedulerConfig
from asyncstep.datatypes import GrammarOutput, ModelRunnerOutput
from asyncstep.engine.core.request import Request
from asyncstep.engine.core.scheduler import Scheduler
from asyncstep.models.model_loader import LoadedModel
from asyncstep.runner import model_runner as model_runner_module
from asyncstep.runner.cudagraph_runner import CudaGraphRunner
from asyncstep.runner.greedy_graph import GreedyGraphIds, takes_graph_ids
from asyncstep.runner.sampler import Sampler, SamplingMetadata
from asyncstep.runner.step_sampling import StepSampling
from tests.engine.test_engine import generate_all
from tests.runner.test_cudagraph import STAND_IN
from tests.runner.test_step_inputs import (
    BLOCK,
    MAX_MODEL_LEN,
    VOCAB,
    Scenario,
    _any_mode,
    _full_stub,
    make_runner,
    run_lockstep,
)


def test_the_graphs_argmax_is_the_samplers_ties_to_the_lowest_id() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 1500)
    logits[1, [7, 900, 1499]] = 50.0  # a three-way tie: the lowest id wins
    logits[2] = float("-inf")
    logits[2, [3, 1200]] = 0.0
    greedy = GreedyGraphIds(8, torch.device("cpu"))
    greedy.ids.fill_(-1)
    out = greedy.wrap(lambda: logits, 4)()
    assert out is logits
    metadata = SamplingMetadata.from_params(
        [SamplingParams(temperature=0)] * 4, {}, torch.device("cpu")
    )
    want = Sampler()(logits, metadata).sampled_token_ids
    assert greedy.ids[:4].tolist() == want.tolist()
    assert want[1] == 7 and want[2] == 3
    assert greedy.ids[4:].tolist() == [-1] * 4  # only its graph's rows


@pytest.mark.parametrize(
    ("params", "takes"),
    [
        ([SamplingParams(temperature=0)] * 3, True),
        ([SamplingParams(temperature=0, top_k=5, top_p=0.5)], True),  # greedy ignores them
        ([SamplingParams(temperature=0), SamplingParams(temperature=0.7)], False),
        ([SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2)], False),
        ([SamplingParams(temperature=0, repetition_penalty=1.2)], False),
        ([SamplingParams(temperature=0, logit_bias={3: 5.0})], False),
        ([SamplingParams(temperature=0, min_tokens=4)], False),
    ],
)
def test_only_plain_greedy_batches_take_the_graphs_ids(
    params: list[SamplingParams], takes: bool
) -> None:
    metadata = SamplingMetadata.from_params(params, {}, torch.device("cpu"))
    assert takes_graph_ids(metadata) is takes


def _count_graph_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps whose tokens came from a graph's argmax: ``[n]``."""
    taken = [0]
    graph_ids = StepSampling._graph_greedy_ids

    def spy(self: StepSampling, state: Any, metadata: SamplingMetadata) -> torch.Tensor | None:
        ids = graph_ids(self, state, metadata)
        taken[0] += ids is not None
        return ids

    monkeypatch.setattr(StepSampling, "_graph_greedy_ids", spy)
    return taken


@pytest.mark.parametrize("mode", ["sync", "async", "pipeline"])
def test_the_graphs_argmax_gives_the_samplers_tokens_step_by_step(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Two runners, ``greedy_in_graph`` on and off, in lockstep: the same
    inputs, batches and outputs (tokens, log-probs) every step. Greedy
    requests decode alone, then a request with log-probs joins (its steps
    sample), a seeded one, one finishes early, one is aborted; then greedy
    alone again."""
    prompts = [[(11 * i + 5 * j) % VOCAB + 3 for j in range(4 + 3 * i)] for i in range(6)]
    scenario = Scenario(
        mode=mode,
        graphs="FULL_AND_PIECEWISE",
        max_num_seqs=4,
        budget=16,
        num_blocks=24,
        prefix_caching=False,
        requests=[
            (0, prompts[0], 30, None, "greedy"),
            (0, prompts[1], 6, None, "greedy"),  # finishes early
            (0, prompts[2], 24, 15, "greedy"),  # aborted
            (8, prompts[3], 6, None, "logprobs"),  # joins
            (12, prompts[4], 5, None, "seeded"),
            (14, prompts[5], 8, None, "greedy"),
        ],
        compare="greedy",
    )
    taken = _count_graph_steps(monkeypatch)
    run_lockstep(tiny_model, scenario)
    assert taken[0] >= 10


def test_a_step_with_a_grammar_samples_the_masked_logits(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A greedy request's FULL decode steps: the first takes the graph's
    argmax; those with a grammar bitmask (one token allowed, not the
    argmax) sample the masked logits instead."""
    monkeypatch.setattr(model_runner_module, "resolve_cudagraph_mode", _any_mode)
    monkeypatch.setattr(CudaGraphRunner, "run", _full_stub)
    runner = make_runner(
        tiny_model, Scenario("sync", "FULL_AND_PIECEWISE", 2, 16, 24, False, []), fast=True
    )
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        24,
        max_model_len=MAX_MODEL_LEN,
    )
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    sched.add_request(Request("r0", [5, 6, 7], params))
    vocab = tiny_model.model.config.vocab_size
    tokens = []
    for step in range(5):
        so = sched.schedule()
        assert runner.execute_model(so) is None
        grammar = None
        if step >= 2:
            words = np.zeros(-(-vocab // 32), dtype="<i4")
            words[0] = 1 << (3 + step)  # token 3 + step alone
            grammar = GrammarOutput(so.step_id, ["r0"], words.tobytes())
        out = runner.sample_tokens(grammar)
        assert isinstance(out, ModelRunnerOutput)
        tokens.append(out.sampled_token_ids[0][0])
        sched.update_from_output(so, out)
    assert tokens[2:] == [5, 6, 7]
    assert runner.step_inputs.cudagraph_steps["FULL"] == 4
    assert runner.sampling.num_graph_greedy_steps == 1


PROMPTS = [[9, 8, 7, 6, 5, 4, 3, 2, 1], [42], [5] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
MIXED = [
    GREEDY,
    SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=3, ignore_eos=True),
]


async def run_engine_mixed(model: LoadedModel, **options: Any) -> tuple[list[Any], Any]:
    """PROMPTS greedy (every decode step plain greedy), then at once a
    greedy one, one with log-probs and a seeded one (mixed steps; the
    greedy one alone at the end): each request's tokens and log-probs."""
    async with asyncstep.open_engine(
        model,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        cudagraph_capture_sizes=[1, 2, 4, 8, 16],
        **options,
    ) as engine:
        results = await generate_all(engine, PROMPTS, GREEDY)
        mixed: list[Any] = [None] * len(MIXED)

        async def one(i: int) -> None:
            mixed[i] = await engine.generate(PROMPTS[i], MIXED[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(MIXED)):
                tg.start_soon(one, i)
        runner = engine.core.executor.runner  # type: ignore[attr-defined]
        return [(r.token_ids, r.logprobs) for r in results + mixed], runner


@pytest.mark.trio
@pytest.mark.parametrize("overlap", [True, False])
async def test_the_engine_gives_the_same_tokens_with_the_graphs_argmax(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """FULL graphs on the Triton kernels (interpreted on the CPU; real
    graphs on CUDA), async scheduling on and off: the tokens and log-probs
    of ``greedy_in_graph`` off."""
    pytest.importorskip("triton")
    options: dict[str, Any] = {
        "attention_backend": "triton",
        "cudagraph_stand_in": STAND_IN,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "async_scheduling": overlap,
    }
    taken = _count_graph_steps(monkeypatch)
    off, _ = await run_engine_mixed(tiny_model, greedy_in_graph=False, **options)
    assert taken[0] == 0
    on, runner = await run_engine_mixed(tiny_model, **options)
    assert on == off
    assert taken[0] >= 4 and runner.sampling.num_graph_greedy_steps == taken[0]
