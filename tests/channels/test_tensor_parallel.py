"""Tensor parallelism is right and shards the weights.

A 2-rank and a 3-rank TP world (``tests/distributed.py``; gloo on CPU) are
each spawned once and run all their scenarios: a :class:`ModelRunner` per
rank, driven by hand-made SchedulerOutputs (a batch of prompts of different
lengths, a chunked prefill, decodes), with and without sequence parallelism,
and with two pipeline stages run back to back in the rank's process (each TP
lane hands its intermediate tensors to its own next stage, as the PP channel
would).
Every step's logits must match the single-rank run of the same weights
(computed in the test process) and greedy tokens must be identical. The
step token counts (11, 5, 7, 4, 4) are not multiples of 2 or 3, so sequence
parallelism pads them.

The weights are dummy weights at ``scale=0.2``: peaked logits, so argmax is
not flipped by fp32 reduction-order noise (the reference asserts the gap).

``ASYNCSTEP_TEST_DEVICE=cuda`` runs the ranks on GPUs over NCCL (the 3-rank
world needs 3 GPUs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from distributed import ParallelGroups, World

from asyncstep.channels import (
    GroupCoordinator,
    get_pp_group,
    get_tp_group,
    set_parallel_groups,
)
from asyncstep.datatypes import (
    CachedRequestData,
    IntermediateTensors,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import SHAPES, dummy_weights
from asyncstep.models.layers.attention import Attention
from asyncstep.models.layers.linear import gather_tokens, reduce_partial_sums
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.runner.model_runner import ModelRunner

DEVICE = torch.device(os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu"))
BACKEND = "nccl" if DEVICE.type == "cuda" else "gloo"
SEED = 1
TIMEOUT_S = 60.0
BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)

#: Heads and intermediate size divisible by 2; vocab 501 is not (padded to 502).
ARCH_TP2 = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=501,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
#: SmolLM2's head layout (9 query / 3 KV heads), tied embeddings; vocab 500
#: is not divisible by 3 (padded to 501).
ARCH_TP3 = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=500,
    hidden_size=72,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)

PROMPTS = {
    "a": [5, 17, 300, 42, 8],
    "b": [101, 7, 499, 3, 250, 66, 12],
    "c": [9, 400],
    "d": [33, 1, 77, 123],
}
#: KV blocks of each request (room for 16 tokens).
BLOCKS = {r: list(range(4 * i, 4 * i + 4)) for i, r in enumerate(PROMPTS)}
#: Tokens scheduled per request and step: b's prompt is split over steps 1-2
#: (chunked prefill), d joins at step 3, then everyone decodes.
SCHEDULE: list[dict[str, int]] = [
    {"a": 5, "b": 4, "c": 2},
    {"a": 1, "b": 3, "c": 1},
    {"a": 1, "b": 1, "c": 1, "d": 4},
    {"a": 1, "b": 1, "c": 1, "d": 1},
    {"a": 1, "b": 1, "c": 1, "d": 1},
]


@dataclass(frozen=True)
class Scenario:
    name: str
    sequence_parallel: bool
    pp_stages: int = 1


SCENARIOS_TP2 = (
    Scenario("tp", sequence_parallel=False),
    Scenario("sp", sequence_parallel=True),
    Scenario("tp+pp", sequence_parallel=False, pp_stages=2),
    Scenario("sp+pp", sequence_parallel=True, pp_stages=2),
)
SCENARIOS_TP3 = (
    Scenario("tp", sequence_parallel=False),
    Scenario("sp", sequence_parallel=True),
)


#: A world's results: one dict per rank (scenario name -> steps, and
#: "param_bytes"), and the single-rank reference ("steps", "param_bytes").
WorldResults = tuple[list[dict[str, Any]], dict[str, Any]]


@dataclass
class StepResult:
    logits: np.ndarray  # [sampling requests, vocab], in batch row order
    sampled: dict[str, list[int]]
    #: Row counts of (hidden_states, residual) handed between pipeline stages.
    intermediate_rows: tuple[int, int] | None = None


# -- building and driving a model --------------------------------------------


@contextmanager
def _groups(
    tp: GroupCoordinator | None = None, pp: GroupCoordinator | None = None
) -> Iterator[None]:
    """Build models as a given TP rank / PP stage (the layers read the groups
    when built); the process's groups are restored after."""
    old_tp, old_pp = get_tp_group(), get_pp_group()
    set_parallel_groups(tp or old_tp, pp or old_pp)
    try:
        yield
    finally:
        set_parallel_groups(old_tp, old_pp)


def _fake_group(rank_in_group: int, size: int) -> GroupCoordinator:
    """A group's shape without a process group (enough to build layers)."""
    return GroupCoordinator(ranks=tuple(range(size)), rank_in_group=rank_in_group)


def _local_device() -> torch.device:
    """This process's device (a rank's GPU was set by the harness)."""
    if DEVICE.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return DEVICE


def build_model(
    arch: ModelArchConfig, *, sequence_parallel: bool = False, stage: int = 0, stages: int = 1
) -> LlamaForCausalLM:
    """The model (or one pipeline stage of it) on this process's device, as
    this process's TP rank, with the dummy weights every rank shares."""
    pp = _fake_group(stage, stages) if stages > 1 else None
    with _groups(pp=pp), torch.device(_local_device()):
        model = LlamaForCausalLM(arch, sequence_parallel=sequence_parallel)
    needed = model.expected_weight_names()
    loaded = model.load_weights(dummy_weights(arch, seed=SEED, scale=0.2, names=needed))
    assert loaded == needed
    return model.eval()


def make_runner(model: LlamaForCausalLM) -> ModelRunner:
    runner = ModelRunner(
        model,
        device=_local_device(),
        dtype=torch.float32,
        max_model_len=64,
        max_num_reqs=8,
        block_size=BLOCK,
    )
    runner.initialize_kv_cache(4 * len(PROMPTS))
    return runner


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_schedule(stages: list[ModelRunner]) -> list[StepResult]:
    """Drive ``SCHEDULE`` through a pipeline of runners (one runner: no
    pipeline). A stage that does not sample learns the sampled tokens from
    the next step's ``new_token_ids``, as from the engine."""
    computed: dict[str, int] = {}
    sampled: dict[str, list[int]] = {}
    results = []
    for step_id, tokens in enumerate(SCHEDULE, 1):
        new = [
            NewRequestData(r, PROMPTS[r], GREEDY, BLOCKS[r], 0) for r in tokens if r not in computed
        ]
        old = [r for r in tokens if r in computed]
        cached = CachedRequestData(
            req_ids=old,
            resumed_from_preemption=[False] * len(old),
            new_token_ids=[sampled.get(r, []) for r in old],
            new_block_ids=[[] for _ in old],
            num_computed_tokens=[computed[r] for r in old],
        )
        so = SchedulerOutput(step_id, new, cached, dict(tokens), sum(tokens.values()))
        intermediate, rows = None, None
        for runner in stages[:-1]:
            out = runner.execute_model(so, intermediate)
            assert isinstance(out, IntermediateTensors)
            intermediate, rows = out, (len(out["hidden_states"]), len(out["residual"]))
        assert stages[-1].execute_model(so, intermediate) is None
        state = stages[-1].execute_model_state
        assert state is not None
        logits = state.logits.cpu().numpy()
        output = stages[-1].sample_tokens()
        sampled = dict(zip(output.req_ids, output.sampled_token_ids, strict=True))
        for r, n in tokens.items():
            computed[r] = computed.get(r, 0) + n
        results.append(StepResult(logits, sampled, rows))
    return results


# -- the ranks ----------------------------------------------------------------


def _check_helpers(tp: GroupCoordinator) -> None:
    """gather_tokens / reduce_partial_sums: shapes and values, SP and not."""
    n, size, rank = 2 * tp.world_size, tp.world_size, tp.rank_in_group
    base = torch.arange(n * 3, dtype=torch.float32, device=_local_device()).view(n, 3)
    x, total = base * (rank + 1), base * (size * (size + 1) / 2)
    shard = reduce_partial_sums(x.clone(), sequence_parallel=True)
    assert shard.shape == (n // size, 3)
    torch.testing.assert_close(shard, total[rank * 2 : rank * 2 + 2])
    torch.testing.assert_close(gather_tokens(shard, sequence_parallel=True), total)
    torch.testing.assert_close(reduce_partial_sums(x.clone(), sequence_parallel=False), total)
    assert gather_tokens(x, sequence_parallel=False) is x


def _run_scenario(arch: ModelArchConfig, scenario: Scenario) -> list[StepResult]:
    sp, n = scenario.sequence_parallel, scenario.pp_stages
    models = [build_model(arch, sequence_parallel=sp, stage=i, stages=n) for i in range(n)]
    for model in models:
        assert model.num_tokens_multiple == (get_tp_group().world_size if sp else 1)
        assert model.pp_all_gather_keys() == {"hidden_states": not sp, "residual": not sp}
    return run_schedule([make_runner(m) for m in models])


async def _rank_scenarios(
    groups: ParallelGroups, arch: ModelArchConfig, scenarios: tuple[Scenario, ...]
) -> dict[str, Any]:
    """On every rank of a TP world: the helpers, the weight bytes, every scenario."""
    _check_helpers(groups.tp)
    out: dict[str, Any] = {"param_bytes": param_bytes(build_model(arch))}
    for scenario in scenarios:
        out[scenario.name] = _run_scenario(arch, scenario)
    return out


def run_world(tp_size: int, arch: ModelArchConfig, scenarios: tuple[Scenario, ...]) -> WorldResults:
    """The single-rank reference (here), then every scenario on ``tp_size`` ranks."""
    single = build_model(arch)
    reference = {"param_bytes": param_bytes(single), "steps": run_schedule([make_runner(single)])}
    with World(tp_size, tp_size=tp_size, backend=BACKEND, dist_timeout_s=TIMEOUT_S) as world:
        per_rank = world.run(_rank_scenarios, arch, scenarios, timeout_s=TIMEOUT_S)
    return per_rank, reference


@pytest.fixture(scope="module")
def world_tp2() -> WorldResults:
    return run_world(2, ARCH_TP2, SCENARIOS_TP2)


@pytest.fixture(scope="module")
def world_tp3() -> WorldResults:
    if DEVICE.type == "cuda" and torch.cuda.device_count() < 3:
        pytest.skip("needs 3 GPUs")
    return run_world(3, ARCH_TP3, SCENARIOS_TP3)


@pytest.fixture
def world(request: pytest.FixtureRequest, tp_size: int) -> WorldResults:
    return request.getfixturevalue(f"world_tp{tp_size}")


# -- the tests ----------------------------------------------------------------

CASES = [(2, s.name) for s in SCENARIOS_TP2] + [(3, s.name) for s in SCENARIOS_TP3]


@pytest.mark.parametrize(("tp_size", "scenario"), CASES, ids=[f"tp{t}-{s}" for t, s in CASES])
def test_logits_and_tokens_match_single_rank(
    world: WorldResults, tp_size: int, scenario: str
) -> None:
    per_rank, reference = world
    ref_steps: list[StepResult] = reference["steps"]
    for ref in ref_steps:  # peaked logits: fp32 noise cannot flip the argmax
        top2 = np.sort(ref.logits, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 1e-4
    assert [len(r.logits) for r in ref_steps] == [2, 3, 4, 4, 4]  # requests sampling
    for rank, out in enumerate(per_rank):
        steps: list[StepResult] = out[scenario]
        for i, (got, ref) in enumerate(zip(steps, ref_steps, strict=True)):
            torch.testing.assert_close(
                torch.from_numpy(got.logits),
                torch.from_numpy(ref.logits),
                rtol=1e-5,
                atol=1e-5,
                msg=lambda m, rank=rank, i=i: f"rank {rank}, step {i + 1}: {m}",
            )
            assert got.sampled == ref.sampled, f"rank {rank}, step {i + 1}"


def test_sequence_parallel_intermediate_tensors_are_token_shards(
    world_tp2: WorldResults,
) -> None:
    """Between pipeline stages: every token's row on each TP lane without SP
    (no padding); with SP, each lane's shard of the padded step."""
    per_rank, _ = world_tp2
    totals = [sum(t.values()) for t in SCHEDULE]
    for out in per_rank:
        assert [s.intermediate_rows for s in out["tp+pp"]] == [(n, n) for n in totals]
        shards = [-(-n // 2) for n in totals]
        assert [s.intermediate_rows for s in out["sp+pp"]] == [(n, n) for n in shards]


@pytest.mark.parametrize("tp_size", [2, 3])
def test_weights_are_sharded(world: WorldResults, tp_size: int) -> None:
    """Each rank holds ~1/TP of the weights (plus the replicated norms and
    the vocabulary padding)."""
    per_rank, reference = world
    single = reference["param_bytes"]
    sizes = [out["param_bytes"] for out in per_rank]
    print(f"tp={tp_size}: single rank {single:,} B; per rank {sizes} B ({sizes[0] / single:.2%})")
    assert len(set(sizes)) == 1
    assert single / tp_size < sizes[0] < 1.02 * single / tp_size


@pytest.mark.parametrize(
    ("shape", "tp_size"),
    [("smollm2-135m", 3), ("llama-1b", 2), ("llama-8b", 8), ("qwen3-0.6b", 4)],
)
def test_weight_bytes_per_rank_of_real_shapes(shape: str, tp_size: int) -> None:
    """Real model shapes, built on the meta device as each TP rank: every
    rank's parameter bytes are ~1/TP of the single-rank model's."""
    arch = SHAPES[shape]
    with torch.device("meta"):
        single = param_bytes(LlamaForCausalLM(arch))
        sizes = []
        for rank in range(tp_size):
            with _groups(tp=_fake_group(rank, tp_size)):
                sizes.append(param_bytes(LlamaForCausalLM(arch)))
    print(
        f"{shape} fp32, tp={tp_size}: single {single / 2**20:,.1f} MiB; per rank "
        f"{sizes[0] / 2**20:,.1f} MiB ({sizes[0] / single:.2%})"
    )
    assert len(set(sizes)) == 1
    assert single / tp_size <= sizes[0] < 1.005 * single / tp_size


def test_runner_padding_gives_the_same_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step padded to a multiple of 4 (what sequence parallelism asks):
    the attention writes and attends only the real tokens, its padding rows
    are zeros, and the logits are those of the unpadded step (layer by
    layer: the CPU's float32 stack would run the unpadded steps without the
    hooked attention module)."""
    from asyncstep.ops.cpu.f32_stack import CpuF32Stack

    monkeypatch.setattr(CpuF32Stack, "build", classmethod(lambda *_: None))
    model = build_model(ARCH_TP2)
    attn = model.attention_layers()[0]
    seen: list[tuple[int, int, torch.Tensor]] = []

    def hook(module: Attention, args: tuple[Any, ...], out: torch.Tensor) -> None:
        seen.append((args[0].shape[0], args[3].num_actual_tokens, out))

    plain = run_schedule([make_runner(model)])
    handle = attn.register_forward_hook(hook)
    padded_runner = make_runner(model)
    padded_runner.step_inputs.num_tokens_multiple = 4
    try:
        padded = run_schedule([padded_runner])
    finally:
        handle.remove()
    for got, ref in zip(padded, plain, strict=True):
        torch.testing.assert_close(torch.from_numpy(got.logits), torch.from_numpy(ref.logits))
        assert got.sampled == ref.sampled
    totals = [sum(t.values()) for t in SCHEDULE]
    assert [(rows, n) for rows, n, _ in seen] == [(-(-n // 4) * 4, n) for n in totals]
    for rows, n, out in seen:
        assert out.shape[0] == rows and not out[n:].any()
