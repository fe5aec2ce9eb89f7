"""On a CUDA device: greedy sampling inside the FULL decode graph
(``greedy_in_graph``, :mod:`asyncstep.runner.greedy_graph`) in real CUDA
graphs: the captured argmax is the sampler's over bf16 logits of llama's
vocabulary (ties to the lowest id), the host copy of the ids reads them
before the next replay rewrites them, and the engine
gives the tokens and log-probs of ``greedy_in_graph`` off (tiny-llama and
llama-1b's shape, dummy weights, async scheduling on and off). Skipped
without CUDA; run on the GPU machine with ``ASYNCSTEP_TEST_DEVICE=cuda``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncstep.config import ModelConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.device.cuda_graph import GraphPool, capture_graph
from asyncstep.models.model_loader import load_model
from asyncstep.runner.greedy_graph import GreedyGraphIds
from asyncstep.runner.host_copy import copy_to_host_in_order
from asyncstep.runner.sampler import Sampler, SamplingMetadata
from tests.runner.test_greedy_graph import run_engine_mixed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 128256  # llama 3's


@pytest.mark.parametrize("rows", [1, 32, 72])  # the chunked argmax up to 64 rows, then torch's
def test_the_captured_argmax_is_the_samplers_on_bf16_logits(rows: int) -> None:
    cuda = torch.device("cuda")
    torch.manual_seed(0)
    logits = torch.zeros(rows, VOCAB, dtype=torch.bfloat16, device=cuda)
    greedy = GreedyGraphIds(128, cuda)
    graph = capture_graph(greedy.wrap(lambda: logits * 1, rows), GraphPool(cuda))
    sampler = Sampler()
    metadata = SamplingMetadata.from_params([SamplingParams(temperature=0)] * rows, {}, cuda)
    for _ in range(3):
        logits.copy_(torch.randn(rows, VOCAB, device=cuda).to(torch.bfloat16))
        logits[0, [5, 70000, VOCAB - 1]] = 100.0  # ties: the lowest id
        logits[-1, 1000:1500] = 100.0
        graph.replay()
        want = sampler(logits, metadata).sampled_token_ids
        torch.cuda.synchronize()
        assert greedy.ids[:rows].tolist() == want.tolist()
        assert want[0] == 5 and want[-1] == (1000 if rows > 1 else 5)


def test_the_host_copy_reads_the_ids_before_the_next_replay_rewrites_them() -> None:
    """The device still busy (a sleep) when the host enqueues the copy and
    the next replay: the copy, in order on the compute stream, reads the
    first replay's ids, not the second's."""
    cuda = torch.device("cuda")
    value = torch.zeros(1, 8, device=cuda)
    greedy = GreedyGraphIds(4, cuda)
    graph = capture_graph(greedy.wrap(lambda: value * 1, 1), GraphPool(cuda))
    torch.cuda._sleep(200_000_000)  # ~0.1 s on an H100's clock
    value[0, 3] = 1.0
    graph.replay()
    (host,), event = copy_to_host_in_order([greedy.ids[:1]], cuda)
    value.zero_()
    value[0, 6] = 1.0
    graph.replay()
    event.synchronize()
    assert host.tolist() == [3]
    torch.cuda.synchronize()
    assert greedy.ids[:1].tolist() == [6]


@pytest.mark.trio
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("shape", ["tiny-llama", "llama-1b"])
async def test_the_engine_gives_the_same_tokens_in_real_graphs(shape: str, overlap: bool) -> None:
    loaded = load_model(
        ModelConfig(model=shape, load_format="dummy", device="cuda", dtype="bfloat16")
    )
    options: dict[str, Any] = {"cudagraph_mode": "FULL_AND_PIECEWISE", "async_scheduling": overlap}
    off, _ = await run_engine_mixed(loaded, greedy_in_graph=False, **options)
    on, runner = await run_engine_mixed(loaded, **options)
    assert on == off
    assert runner.sampling.num_graph_greedy_steps >= 4
