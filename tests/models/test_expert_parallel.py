"""Expert parallelism (``enable_expert_parallel``), on the CPU with gloo.

The layer, in one 4-rank world (TP = 2 x PP = 2, so EP = 2 over each TP
group and EP = 4 over the world): the group's all-to-all (uneven splits,
empty ones, the async form); a sparse MoE block whose ranks hold
``E / ep`` whole experts gives the one-rank block's rows and expert counts,
for replicated rows and under sequence parallelism, down to steps of fewer
rows than ranks.

The engine: the MoE families' tiny checkpoints of ``test_moe`` give
transformers' greedy tokens (32 tokens, 3 prompts, fp32) with TP = 2 + EP
(OLMoE's under sequence parallelism; Mixtral's in micro-batches, below) and
Qwen3-MoE's with PP = 2 x TP = 2 + EP; the windowed Mixtral's (past its
window) with TP = 4 + EP (EP = 4).

Load balance: a MoE model's rows per expert of each step reach its
``output`` span, the engine's statistics and ``/metrics``.

The door: EP for a dense model, or a TP size that does not divide the
experts, is refused in one line; with EP a TP size need not divide the
experts' intermediate size; one TP rank makes it a no-op. Each rank builds
(and the memory estimate counts) its experts only, and asks the checkpoint
for them only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep.channels import GroupCoordinator, get_ep_group, set_parallel_groups
from asyncstep.channels.parallel_state import ParallelGroups, get_pp_group, get_tp_group
from asyncstep.config import ParallelConfig
from asyncstep.engine.front_end.statistics import EngineStatistics
from asyncstep.errors import ConfigError
from asyncstep.logging import configure_logging
from asyncstep.models import memory
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.layers.moe import SparseMoeBlock
from asyncstep.models.model_info import validate_parallel_layout
from asyncstep.models.registry import model_class
from tests.distributed import World
from tests.models.hf_parity import MAX_TOKENS, PROMPTS, Checkpoint
from tests.models.test_moe import (  # noqa: F401 (checkpoints: a fixture)
    PARITY,
    WINDOW_PARITY,
    checkpoints,
    hf_dict,
)

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 16, 12
#: Steps' row counts: none on some ranks (1 row over 4), uneven, even.
ROWS = [1, 3, 4, 13, 16]


# -- the layer, in a 4-rank world ---------------------------------------------


async def all_to_all_scenario(groups: ParallelGroups) -> list[list[float]]:
    """Rank r sends ``s + 10 r`` (``s`` times) to each rank s: uneven splits,
    rank 0 sends nothing to itself; over the TP group, then the world."""
    got = []
    for group in (groups.tp, groups.world):
        me = group.rank_in_group
        splits = list(range(group.world_size))
        x = torch.cat([torch.full((s, 2), float(s + 10 * me)) for s in splits])
        out, work = group.all_to_all_async(x, [me] * group.world_size, splits)
        assert work is not None
        work.wait()
        assert torch.equal(group.all_to_all(x, [me] * group.world_size, splits), out)
        got.append(out[:, 0].tolist())
    return got


def make_block(seed: int, sequence_parallel: bool = False) -> SparseMoeBlock:
    """A block of the current groups, holding its experts of the seeded
    full weights."""
    block = SparseMoeBlock(
        NUM_EXPERTS,
        TOP_K,
        HIDDEN,
        INTER,
        renormalize=True,
        sequence_parallel=sequence_parallel,
    )
    generator = torch.Generator().manual_seed(seed)
    gate = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)
    w13 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=generator) * 0.3
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=generator) * 0.3
    block.gate.weight.data.copy_(gate)
    experts = block.experts
    start = experts.expert_start
    for e in range(NUM_EXPERTS):
        experts.weight_loader(experts.w13_weight, w13[e, :INTER], (e, "w1"))
        experts.weight_loader(experts.w13_weight, w13[e, INTER:], (e, "w3"))
        experts.weight_loader(experts.w2_weight, w2[e], (e, "w2"))
    assert experts.w13_weight.shape[0] == NUM_EXPERTS // experts.ep_size
    assert torch.equal(experts.w2_weight, w2[start : start + experts.num_local_experts])
    return block


async def block_scenario(groups: ParallelGroups) -> dict[str, Any]:
    """Every case's max difference from the one-rank block, and whether its
    expert counts equal the one-rank block's."""
    single = GroupCoordinator.single()
    results: dict[str, Any] = {}
    for name, ep in (("ep2", groups.tp), ("ep4", groups.world)):
        for sp in (False, True):
            rows_run = [r for r in ROWS if not sp or r % ep.world_size == 0]  # SP pads steps
            inputs = [
                torch.randn(r, HIDDEN, generator=torch.Generator().manual_seed(r)) for r in rows_run
            ]
            set_parallel_groups(single, single)  # the reference reduces over no group
            reference = make_block(seed=1)
            expected = [reference(x) for x in inputs]
            set_parallel_groups(ep, single, ep)
            try:
                block = make_block(seed=1, sequence_parallel=sp)
                for x, want in zip(inputs, expected, strict=True):
                    if sp:
                        share = x.shape[0] // ep.world_size
                        start = ep.rank_in_group * share
                        got, want = block(x[start : start + share]), want[start : start + share]
                    else:
                        got = block(x)
                    key = f"{name} sp={sp} rows={x.shape[0]}"
                    results[key] = (got - want).abs().max().item()
                counts = block.experts.tokens_per_expert
                results[f"{name} sp={sp} counts"] = (
                    counts.tolist(),
                    reference.experts.tokens_per_expert.tolist(),
                )
            finally:
                set_parallel_groups(groups.tp, groups.pp)
    return results


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with World(4, tp_size=2, pp_size=2) as world:
        yield world


def test_all_to_all_uneven_splits(world: World) -> None:
    per_rank = world.run(all_to_all_scenario)
    for rank, (tp, everyone) in enumerate(per_rank):
        tp_rank = rank % 2
        assert tp == [float(tp_rank + 10 * s) for s in range(2) for _ in range(tp_rank)]
        assert everyone == [float(rank + 10 * s) for s in range(4) for _ in range(rank)]


def test_ep_block_equals_one_rank(world: World) -> None:
    per_rank = world.run(block_scenario, timeout_s=120)
    for rank, results in enumerate(per_rank):
        for key, value in results.items():
            if key.endswith("counts"):
                got, expected = value  # every rank counts the whole group's rows
                assert got == expected, (rank, key)
            else:
                assert value < 1e-5, (rank, key, value)
    cases = [k for k in per_rank[0] if not k.endswith("counts")]
    assert len(cases) == 2 * (len(ROWS) + 2)  # SP: the 2 row counts that 4 divides


# -- the engine: transformers' greedy tokens ----------------------------------

#: Mixtral's EP = 2 engine is the micro-batched one (its tokens are
#: transformers'), its plain EP path the EP = 4 one's: a multi-rank engine
#: costs seconds of CI.
EP_LAYOUTS: dict[str, dict[str, Any]] = {
    "qwen3_moe tp2+ep": {"tensor_parallel_size": 2},
    "olmoe tp2+ep+sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "qwen3_moe pp2xtp2+ep": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}


@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_ep_greedy_equals_transformers(
    layout: str,
    checkpoints: Callable[[str], Checkpoint],  # noqa: F811 (test_moe's fixture)
) -> None:
    path, expected = checkpoints(layout.split()[0])
    options = EP_LAYOUTS[layout] | {"enable_expert_parallel": True}
    assert PARITY.serve(path, **options) == expected


def test_ep4_windowed_mixtral_equals_transformers(
    checkpoints: Callable[[str], Checkpoint],  # noqa: F811 (test_moe's fixture)
) -> None:
    """EP = 4 (TP = 4, one expert a rank, 4 processes on gloo): the windowed
    Mixtral's tokens past its window of 8, as transformers gives them."""
    path, expected = checkpoints("mixtral_window")
    options = {"tensor_parallel_size": 4, "enable_expert_parallel": True, "block_size": 4}
    assert WINDOW_PARITY.serve(path, **options) == expected


# -- the door -----------------------------------------------------------------


def test_bad_expert_parallel_layouts_are_refused_in_one_line() -> None:
    moe = parse_hf_config(hf_dict("olmoe"))  # 4 experts
    dense = moe.replace(architecture="LlamaForCausalLM", num_experts=0, qk_norm=False)
    cases = [
        (dense, 2, "enable_expert_parallel needs a mixture-of-experts model; LlamaForCausalLM"),
        (
            moe.replace(num_experts=6),
            4,
            r"tensor_parallel_size 4 \(the EP size\) does not divide the model's 6 experts",
        ),
        (
            moe.replace(architecture="GptOssForCausalLM", qk_norm=False),
            2,
            "gpt-oss runs its experts split by TP only",
        ),
    ]
    for arch, tp, error in cases:
        parallel = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=True)
        with pytest.raises(ConfigError, match=error) as caught:
            validate_parallel_layout(arch, parallel)
        assert "\n" not in str(caught.value)
    # EP keeps experts whole: a TP size need not divide their intermediate size.
    odd = moe.replace(moe_intermediate_size=30, num_key_value_heads=4)
    four = ParallelConfig(tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="expert intermediate size"):
        validate_parallel_layout(odd, four)
    validate_parallel_layout(
        odd, ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True)
    )
    # One TP rank: a no-op, accepted.
    validate_parallel_layout(moe, ParallelConfig(enable_expert_parallel=True))


def as_ep_rank(rank: int, size: int) -> tuple[GroupCoordinator, GroupCoordinator]:
    group = GroupCoordinator(ranks=tuple(range(size)), rank_in_group=rank)
    return group, GroupCoordinator.single()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_each_rank_builds_and_loads_its_experts_only(family: str) -> None:
    arch = parse_hf_config(hf_dict(family))
    old = get_tp_group(), get_pp_group(), get_ep_group()
    try:
        for rank in range(2):
            tp, pp = as_ep_rank(rank, 2)
            set_parallel_groups(tp, pp, tp)
            with torch.device("meta"):
                model = model_class(arch)(arch, torch.float32)
            built = sum(p.numel() for p in model.parameters())
            estimate = memory.rank_param_count(arch, tp_size=2, ep_size=2)
            assert estimate == built
            # Half the experts, whole: as many expert weights as TP's halves.
            assert estimate == memory.rank_param_count(arch, tp_size=2)
            names = model.expected_weight_names()
            experts = {
                int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n
            }
            assert experts == {2 * rank, 2 * rank + 1}
            assert names <= set(arch.weight_shapes())
    finally:
        set_parallel_groups(*old)


def test_expert_parallel_on_a_gpu_runs_eagerly() -> None:
    """The dispatch reads its split sizes on the host: no CUDA graph can
    hold it, so a GPU layout with EP must say cudagraph_mode none."""
    from asyncstep.config import CompilationConfig, EngineConfig

    def config(mode: str, tp: int = 2) -> EngineConfig:
        return EngineConfig(
            parallel=ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=True),
            compilation=CompilationConfig(cudagraph_mode=mode),
        )

    with pytest.raises(ConfigError, match="pass cudagraph_mode none"):
        config("piecewise").resolve_for_device("cuda")
    config("none").resolve_for_device("cuda")
    config("piecewise").resolve_for_device("cpu")
    config("piecewise", tp=1).resolve_for_device("cuda")  # EP of one: a no-op


# -- load balance: tokens per expert per step -----------------------------------


async def serve_with_statistics(path: Path) -> tuple[list[list[int]], EngineStatistics]:
    async with asyncstep.open_engine(
        path, device="cpu", dtype="float32", engine_process=False
    ) as engine:
        results = [(await engine.generate(p, PARITY.params)).token_ids for p in PROMPTS]
        return results, engine.statistics()


def test_tokens_per_expert_reach_the_step_spans_and_metrics(
    checkpoints: Callable[[str], Checkpoint],  # noqa: F811 (test_moe's fixture)
    tmp_path: Path,
) -> None:
    """Every step's rows per expert (both MoE layers summed: 2 x top_k per
    token computed) in its ``output`` span, their sums in the engine's
    statistics and in ``/metrics``'s ``moe_expert_tokens_total``."""
    from asyncstep.server.metrics import _EngineCollector

    path, expected = checkpoints("qwen3_moe")
    log = tmp_path / "log.jsonl"
    configure_logging("warning", log, console=False)
    try:
        tokens, stats = trio.run(serve_with_statistics, path)
    finally:
        configure_logging("warning", console=False)
    assert tokens == expected
    rows = sum(map(len, PROMPTS)) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert len(stats.moe_expert_tokens) == 4
    assert sum(stats.moe_expert_tokens) == 2 * 2 * rows  # 2 MoE layers, top 2
    assert min(stats.moe_expert_tokens) > 0
    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in events if e.get("event") == "span" and "expert_tokens" in e]
    assert steps and all(e["name"] == "output" and e["step"] is not None for e in steps)
    summed = [sum(column) for column in zip(*(e["expert_tokens"] for e in steps), strict=True)]
    assert summed == list(stats.moe_expert_tokens)

    class Engine:
        def statistics(self) -> EngineStatistics:
            return stats

    samples = {
        s.labels["expert"]: s.value
        for family in _EngineCollector(Engine(), "m").collect()  # type: ignore[arg-type]
        for s in family.samples
        if s.name == "asyncstep:moe_expert_tokens_total"
    }
    assert samples == {str(e): float(n) for e, n in enumerate(stats.moe_expert_tokens)}


# -- the qwen3-30b-a3b dummy shape ----------------------------------------------


def test_qwen3_30b_a3b_shape_is_the_real_model() -> None:
    """Its sizes as Qwen3-30B-A3B's config.json gives them (30.5 B
    parameters, 3.3 B active), and each rank of TP = 2 + EP = 2 builds (on
    the meta device: nothing allocated) what the estimate counts, half the
    experts whole."""
    from asyncstep.models.dummy import SHAPES

    arch = SHAPES["qwen3-30b-a3b"]
    arch.validate()
    assert arch.family == "qwen3_moe" and all(map(arch.is_moe_layer, range(48)))
    total = memory.rank_param_count(arch)
    assert 30.4e9 < total < 30.6e9
    expert = 3 * arch.moe_intermediate_size * arch.hidden_size
    active = total - (arch.num_experts - arch.num_experts_per_tok) * expert * 48
    assert 3.2e9 < active < 3.4e9
    validate_parallel_layout(
        arch, ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    )
    small = arch.replace(num_hidden_layers=2)  # the layers alike: two of them suffice
    old = get_tp_group(), get_pp_group(), get_ep_group()
    try:
        tp, pp = as_ep_rank(1, 2)
        set_parallel_groups(tp, pp, tp)
        with torch.device("meta"):
            model = model_class(small)(small, torch.bfloat16)
        experts = model.model.layers[0].mlp.experts
        assert experts.w13_weight.shape == (64, 2 * 768, 2048)
        assert experts.w2_weight.shape == (64, 2048, 768)
        assert experts.expert_start == 64
        built = sum(p.numel() for p in model.parameters())
        assert memory.rank_param_count(small, tp_size=2, ep_size=2) == built
    finally:
        set_parallel_groups(*old)


# -- micro-batches: one's all-to-all in flight while the other's experts run ----


def test_ubatched_ep_gives_the_tokens_and_overlaps_the_exchange(
    checkpoints: Callable[[str], Checkpoint],  # noqa: F811 (test_moe's fixture)
    tmp_path: Path,
) -> None:
    """TP = 2 + EP with micro-batches: transformers' tokens, and in each
    rank's timeline micro-batch 1's dispatch is in flight across micro-batch
    0's expert compute, and 0's combine across 1's, in every MoE layer of
    every micro-batched step."""
    path, expected = checkpoints("mixtral")
    log = tmp_path / "log.jsonl"
    options: dict[str, Any] = {
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
        "enable_ubatching": True,
        "ubatch_decode_threshold": 2,
        "ubatch_prefill_threshold": 4,
        "rank_log_json": str(log),
    }
    configure_logging("warning", log, console=False)
    try:
        assert PARITY.serve(path, **options) == expected
    finally:
        configure_logging("warning", console=False)
    for rank in range(2):
        events = [json.loads(line) for line in (tmp_path / f"log.jsonl.rank{rank}").open()]
        spans: dict[tuple[int, int, str, str], tuple[int, int]] = {
            (e["step"], e["layer"], e["task"], e["name"]): (e["ts_us"], e["ts_us"] + e["dur_us"])
            for e in events
            if e.get("event") == "span" and e.get("task", "").startswith("ubatch")
        }
        steps = {(step, layer) for step, layer, _, _ in spans}
        assert len(steps) >= 2 * 3  # prefill and decodes, 3 MoE layers each
        for step, layer in steps:
            at = {(ub, name): spans[step, layer, ub, name] for _, _, ub, name in spans}
            experts0, dispatch1 = at["ubatch0", "ep_experts"], at["ubatch1", "ep_dispatch"]
            assert dispatch1[0] <= experts0[0] and experts0[1] <= dispatch1[1]
            experts1, combine0 = at["ubatch1", "ep_experts"], at["ubatch0", "ep_combine"]
            assert combine0[0] <= experts1[0] and experts1[1] <= combine0[1]
