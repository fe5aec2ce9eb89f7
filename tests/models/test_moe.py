"""The mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) from tiny
random checkpoints written with transformers' ``save_pretrained``
(safetensors): greedy tokens equal transformers', 32 tokens of 3 prompts
batched together, in fp32 on the CPU, on one rank (whole prompts and chunked
prefill), and with PP = 2 x TP = 2 (OLMoE's under sequence parallelism)
(gloo, a process per rank; the engine core runs in the test's process); from
GGUF files written as llama.cpp's converter writes them, on one rank.
Qwen3-MoE's checkpoint has a dense layer (``mlp_only_layers``) and
renormalised top-k weights; OLMoE's does not renormalise. A Mixtral with a
``sliding_window`` of 8 gives transformers' tokens past its window (its
EP = 4 engine is in ``test_expert_parallel``). Op by op, each family's MoE
block gives transformers' block's rows. The scaffolding (random model, HF's
greedy tokens, ours, the GGUF conversion) is ``tests.models.hf_parity``'s.

Then the door: hostile or unsupported MoE configs (and a GGUF stack of
other experts) are refused with one line before anything is built; a TP
size must divide the experts; the memory estimate counts the experts; the
op set's whole-stack step path is asked for (Triton's fused decode and the
CPU's quantized decode stack decline MoE layers); packing does not apply to
them; each layer counts the rows routed to each expert (load balance)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncstep.config import ModelConfig
from asyncstep.errors import ConfigError, ModelLoadError, UnsupportedModelError
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.model_loader import load_model
from asyncstep.models.moe import MoeForCausalLM
from asyncstep.models.registry import model_class
from tests.models.hf_parity import (
    LONG_PROMPTS,
    MAX_TOKENS,
    PROMPTS,
    Checkpoint,
    Parity,
    hf_greedy,
    moe_block_differences,
    random_model,
    tiny_fields,
    write_hf_gguf,
)
from tests.models.test_hostile_files import assert_each_rank_builds_the_estimate

PARITY = Parity(PROMPTS)
#: The windowed Mixtral's window, and prompts longer than it.
WINDOW = 8
WINDOW_PARITY = Parity(LONG_PROMPTS)
FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]
#: Every family's layouts (a multi-rank engine costs seconds: one of them,
#: TP and PP at once).
LAYOUTS: dict[str, dict[str, Any]] = {
    "one rank": {},
    "one rank, chunked prefill": {"max_num_batched_tokens": 4},
    "pp2xtp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}
#: The family whose PP = 2 x TP = 2 runs under sequence parallelism (its q/k
#: norms all-gather the heads' columns, its MoE blocks the token rows).
SEQUENCE_PARALLEL_FAMILY = "olmoe"


def tiny_config(family: str) -> Any:
    import transformers

    common = tiny_fields(num_hidden_layers=3, num_experts_per_tok=2)
    if family.startswith("qwen3_moe"):
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=96,  # the dense layer's
            moe_intermediate_size=32,
            num_experts=4,
            norm_topk_prob=True,
            # A GGUF has no dense layers in a MoE model.
            mlp_only_layers=[] if family.endswith("gguf") else [1],
        )
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4)
    if family == "mixtral_window":  # 4 KV heads: TP = 4 (EP = 4) divides them
        return transformers.MixtralConfig(
            **common | {"num_key_value_heads": 4},
            intermediate_size=32,
            num_local_experts=4,
            sliding_window=WINDOW,
        )
    return transformers.OlmoeConfig(
        **common, intermediate_size=32, num_experts=4, norm_topk_prob=False
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    """A family's tiny random checkpoint and transformers' greedy tokens,
    made once per module (``mixtral_window``'s of the longer prompts)."""
    made: dict[str, Checkpoint] = {}

    def get(family: str) -> Checkpoint:
        if family not in made:
            parity = WINDOW_PARITY if family == "mixtral_window" else PARITY
            attention = "eager" if family == "mixtral_window" else None
            model = random_model(tiny_config(family), attn_implementation=attention)
            made[family] = parity.save(model, tmp_path_factory.mktemp(family))
        return made[family]

    return get


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(family: str, checkpoints: Callable[[str], Checkpoint]) -> Checkpoint:
    return checkpoints(family)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_transformers(family: str, checkpoint: Checkpoint, layout: str) -> None:
    path, expected = checkpoint
    options = LAYOUTS[layout]
    if family == SEQUENCE_PARALLEL_FAMILY and "tensor_parallel_size" in options:
        options = options | {"sequence_parallel": True}
    assert PARITY.serve(path, **options) == expected


def test_windowed_mixtral_past_its_window_equals_transformers(
    checkpoints: Callable[[str], Checkpoint],
) -> None:
    """Mixtral's ``sliding_window`` (every layer), prompts longer than the
    window, 32 tokens well past it: transformers' tokens; the same weights
    in full attention give the longest prompt others (the window matters)."""
    path, expected = checkpoints("mixtral_window")
    assert all(len(p) > WINDOW for p in WINDOW_PARITY.prompts)
    full = AutoModelForCausalLM.from_pretrained(path, sliding_window=None).eval()
    assert hf_greedy(full, LONG_PROMPTS[1]) != expected[1]
    assert WINDOW_PARITY.serve(path) == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_each_moe_block_equals_transformers(
    family: str, checkpoints: Callable[[str], Checkpoint]
) -> None:
    """Op by op: each MoE layer's block (router, top-k, renormalised or not,
    the experts) on random rows gives transformers' block's rows."""
    path, _ = checkpoints(family)
    differences = moe_block_differences(path)
    assert len(differences) == (2 if family == "qwen3_moe" else 3)  # Qwen3-MoE's layer 1 is dense
    assert max(differences) < 1e-6, differences


# -- the door -----------------------------------------------------------------


def hf_dict(family: str, **changes: Any) -> dict[str, Any]:
    config = tiny_config(family).to_dict()
    config["architectures"] = [
        {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}.get(
            family, "OlmoeForCausalLM"
        )
    ]
    config.update(changes)
    return config


@pytest.mark.parametrize(
    ("family", "changes", "error"),
    [
        ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok must be in \[1, 4\], got 5"),
        ("olmoe", {"num_experts": 0}, r"num_experts must be in \[1, 1024\], got 0"),
        ("olmoe", {"num_experts": 2**70}, "num_experts must be in .* an integer of 71 bits"),
        ("mixtral", {"num_local_experts": None}, "'num_local_experts' is missing"),
        ("mixtral", {"num_local_experts": "8"}, "num_local_experts must be an integer"),
        ("qwen3_moe", {"moe_intermediate_size": -32}, "moe_intermediate_size must be in"),
        ("olmoe", {"num_experts_per_tok": True}, "num_experts_per_tok must be an integer"),
        ("qwen3_moe", {"mlp_only_layers": "1"}, "mlp_only_layers must be a list"),
        ("qwen3_moe", {"mlp_only_layers": [3]}, r"mlp_only_layers must be in \[0, 2\], got 3"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be in"),
        ("olmoe", {"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
        (
            "mixtral",
            {"num_hidden_layers": 1000, "num_local_experts": 1000},
            "1000 MoE layers of 1000 experts, more than 65536 experts in all",
        ),
    ],
)
def test_hostile_moe_configs_are_refused_in_one_line(
    family: str, changes: dict[str, Any], error: str
) -> None:
    with pytest.raises(ModelLoadError, match=error) as caught:
        parse_hf_config(hf_dict(family, **changes))
    assert "\n" not in str(caught.value)


def test_unsupported_moe_options_are_named() -> None:
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        parse_hf_config(hf_dict("olmoe", clip_qkv=8.0))
    arch = parse_hf_config(hf_dict("olmoe"))
    with pytest.raises(UnsupportedModelError, match="router scoring 'tanh'"):
        arch.replace(scoring_func="tanh").validate()
    dense = arch.replace(architecture="Qwen3ForCausalLM", qk_norm_per_head=True)
    with pytest.raises(ModelLoadError, match="Qwen3ForCausalLM takes no experts"):
        dense.validate()


def test_configs_read_as_each_family_says() -> None:
    qwen = parse_hf_config(hf_dict("qwen3_moe"))
    assert (qwen.num_experts, qwen.moe_intermediate_size, qwen.intermediate_size) == (4, 32, 96)
    assert qwen.norm_topk_prob and qwen.qk_norm and qwen.qk_norm_per_head
    assert [qwen.is_moe_layer(i) for i in range(3)] == [True, False, True]
    mixtral = parse_hf_config(hf_dict("mixtral", norm_topk_prob=False))
    assert mixtral.norm_topk_prob and not mixtral.qk_norm  # Mixtral always renormalises
    olmoe = parse_hf_config(hf_dict("olmoe"))
    assert not olmoe.norm_topk_prob and olmoe.qk_norm and not olmoe.qk_norm_per_head
    assert olmoe.weight_shapes()["model.layers.0.self_attn.q_norm.weight"] == (64,)
    # A real Qwen3-MoE config names its experts num_experts (transformers 5 writes both).
    both = hf_dict("qwen3_moe", num_experts=8, num_local_experts=4, num_experts_per_tok=8)
    assert parse_hf_config(both).num_experts == 8


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (2, 3)])
def test_estimate_is_the_parameters_each_rank_builds(family: str, tp: int, pp: int) -> None:
    arch = parse_hf_config(hf_dict(family))
    assert_each_rank_builds_the_estimate(arch, tp, pp)


def test_the_cpu_decode_stack_declines_moe_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixtral's layers have no q/k norm, so they reach the MLP check: the
    stack must decline them (None), not read a dense MLP they lack."""
    from asyncstep.ops.cpu import decode_stack

    class FastMatmul:
        fast = True

    monkeypatch.setattr(decode_stack, "quant_matmul", lambda: FastMatmul())
    arch = parse_hf_config(hf_dict("mixtral"))
    model = model_class(arch)(arch, torch.float32)
    assert decode_stack.CpuDecodeStack.build(object(), model.model.stage_layers()) is None  # type: ignore[arg-type]


def test_moe_models_take_no_q4_packing(checkpoint: Checkpoint) -> None:
    path, _ = checkpoint
    with pytest.raises(
        ConfigError, match=r"weight_packing q4 does not apply to .*experts stay dense"
    ):
        load_model(ModelConfig(model=str(path), device="cpu", weight_packing="q4"))


def test_a_bfloat16_moe_model_loads_dense(checkpoint: Checkpoint) -> None:
    path, _ = checkpoint
    loaded = load_model(ModelConfig(model=str(path), device="cpu", dtype="bfloat16"))
    experts = [m for n, m in loaded.model.named_modules() if n.endswith("mlp.experts")]
    assert experts and all(m.w13_weight.dtype == torch.bfloat16 for m in experts)
    packed = [m for m in loaded.model.modules() if getattr(m, "packed", None) is not None]
    assert packed == []
    config = json.loads((path / "config.json").read_text())
    assert loaded.arch_config.architecture == config["architectures"][0]


def test_a_tp_size_that_does_not_divide_the_experts_is_refused() -> None:
    from asyncstep.config import ParallelConfig
    from asyncstep.models.model_info import validate_parallel_layout

    arch = parse_hf_config(hf_dict("qwen3_moe"))
    arch = arch.replace(num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    with pytest.raises(
        ConfigError, match=r"does not divide the model's expert intermediate size \(32\)"
    ):
        validate_parallel_layout(arch, ParallelConfig(tensor_parallel_size=3))


def test_moe_models_ask_their_op_set_for_a_step_path() -> None:
    """A MoE model asks its op set for a whole-stack path: Triton's fused
    decode declines MoE layers (it reads a dense gated MLP), the CPU's
    float32 stack takes them (``test_cpu_f32_stack``)."""
    from asyncstep.ops.torch_ref import TorchOps
    from asyncstep.ops.triton.fused_decode import FusedDecodePath

    asked: list[int] = []

    class StackingOps(TorchOps):
        def step_path(self, layers: list[Any]) -> Any:
            asked.append(len(layers))
            return FusedDecodePath.build(layers)

    ops = StackingOps()
    for family in FAMILIES:
        arch = parse_hf_config(hf_dict(family))
        model = model_class(arch)(arch, torch.float32)
        model.use_ops(ops)
        assert model.model.ops.ops is ops and model.model.step_path is None
    assert asked == [3] * len(FAMILIES)


def test_expert_load_counts_every_routed_row(checkpoints: Callable[[str], Checkpoint]) -> None:
    """Each MoE layer counts top_k rows per token computed: the prompts'
    tokens and every generated token but the last (never fed back)."""
    path, expected = checkpoints("qwen3_moe")
    loaded = load_model(ModelConfig(model=str(path), device="cpu", dtype="float32"))
    model = loaded.model
    assert isinstance(model, MoeForCausalLM)
    assert model.expert_load() == {0: [0] * 4, 2: [0] * 4}  # layer 1 is dense
    assert PARITY.serve(loaded) == expected
    rows = sum(map(len, PROMPTS)) + len(PROMPTS) * (MAX_TOKENS - 1)
    load = model.expert_load(reset=True)
    assert {layer: sum(counts) for layer, counts in load.items()} == {0: 2 * rows, 2: 2 * rows}
    assert all(min(counts) > 0 for counts in load.values())
    assert model.expert_load() == {0: [0] * 4, 2: [0] * 4}


# -- GGUF ---------------------------------------------------------------------

#: Our family -> (its GGUF architecture, the checkpoint to convert).
GGUF_FAMILIES = {"qwen3_moe": ("qwen3moe", "qwen3_moe_gguf"), "mixtral": ("llama", "mixtral")}
GGUF_FAMILIES["olmoe"] = ("olmoe", "olmoe")


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_greedy_equals_transformers(
    family: str, checkpoints: Callable[[str], Checkpoint], tmp_path: Path
) -> None:
    gguf_arch, source = GGUF_FAMILIES[family]
    hf_dir, expected = checkpoints(source)
    path = write_hf_gguf(tmp_path / f"{family}.gguf", hf_dir, gguf_arch)
    assert PARITY.serve(path) == expected


def test_a_gguf_stack_of_other_experts_is_refused(
    checkpoints: Callable[[str], Checkpoint], tmp_path: Path
) -> None:
    hf_dir, _ = checkpoints("olmoe")
    path = write_hf_gguf(tmp_path / "olmoe.gguf", hf_dir, "olmoe", stacked=3)
    error = r"ffn_\w+_exps.weight. has shape \(3, \d+, \d+\), but the metadata implies 4 experts"
    with pytest.raises(ModelLoadError, match=error) as caught:
        load_model(ModelConfig(model=str(path), device="cpu"))
    assert "\n" not in str(caught.value)
