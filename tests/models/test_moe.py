"""The mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE) from tiny
random checkpoints written with transformers' ``save_pretrained``
(safetensors): greedy tokens equal transformers', 32 tokens of 3 prompts
batched together, in fp32 on the CPU, on one rank (whole prompts and chunked
prefill), and with PP = 2 x TP = 2 (OLMoE's under sequence parallelism)
(gloo, a process per rank; the engine core runs in the test's process); from
GGUF files written as llama.cpp's converter writes them, on one rank.
Qwen3-MoE's checkpoint has a dense layer (``mlp_only_layers``) and
renormalised top-k weights; OLMoE's does not renormalise.

Then the door: hostile or unsupported MoE configs (and a GGUF stack of
other experts) are refused with one line before anything is built; a TP
size must divide the experts; the memory estimate counts the experts; no op
set's whole-stack step path is asked for (the CPU's decode stack declines
MoE layers too); packing does not apply to them; each layer counts the rows
routed to each expert (load balance)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.config import ModelConfig
from asyncstep.errors import ConfigError, ModelLoadError, UnsupportedModelError
from asyncstep.models import memory
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.model_loader import LoadedModel, load_model
from asyncstep.models.moe import MoeForCausalLM
from asyncstep.models.registry import model_class
from tests.models.test_hostile_files import as_rank

MAX_TOKENS = 32
PROMPTS = [[3, 17, 92, 5], [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31], [77]]
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

    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_experts_per_tok=2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        # Larger weights than the default make the logits far from ties.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
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
    return transformers.OlmoeConfig(
        **common, intermediate_size=32, num_experts=4, norm_topk_prob=False
    )


def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


Checkpoint = tuple[Path, list[list[int]]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Checkpoint]:
    """A family's tiny random checkpoint and transformers' greedy tokens,
    made once per module."""
    made: dict[str, Checkpoint] = {}

    def get(family: str) -> Checkpoint:
        if family not in made:
            import transformers

            torch.manual_seed(0)
            config = tiny_config(family)
            model = transformers.AutoModelForCausalLM.from_config(config).eval()
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path, safe_serialization=True)
            made[family] = path, [hf_greedy(model, p) for p in PROMPTS]
        return made[family]

    return get


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def checkpoint(family: str, checkpoints: Callable[[str], Checkpoint]) -> Checkpoint:
    return checkpoints(family)


async def serve(path: Path | LoadedModel, **options: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results: list[list[int]] = [[] for _ in PROMPTS]
    async with asyncstep.open_engine(
        path, device="cpu", dtype="float32", engine_process=False, **options
    ) as engine:

        async def one(i: int) -> None:
            results[i] = (await engine.generate(PROMPTS[i], params)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_transformers(family: str, checkpoint: Checkpoint, layout: str) -> None:
    path, expected = checkpoint
    options = LAYOUTS[layout]
    if family == SEQUENCE_PARALLEL_FAMILY and "tensor_parallel_size" in options:
        options = options | {"sequence_parallel": True}
    assert trio.run(lambda: serve(path, **options)) == expected


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
    for pp_rank in range(pp):
        with as_rank(0, tp, pp_rank, pp), torch.device("meta"):
            model = model_class(arch)(arch, torch.float32)
        built = sum(p.numel() for p in model.parameters())
        assert memory.rank_param_count(arch, tp_size=tp, pp_rank=pp_rank, pp_size=pp) == built
        assert model.expected_weight_names() <= set(arch.weight_shapes())


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


def test_moe_models_ask_no_op_set_for_a_step_path() -> None:
    """The whole-stack paths (the CPU's decode stack, Triton's fused decode)
    read a dense gated MLP: a MoE model runs layer by layer on every op set."""
    from asyncstep.ops.torch_ref import TorchOps

    class StackingOps(TorchOps):
        def step_path(self, layers: list[Any]) -> Any:
            raise AssertionError("a MoE model asked for a step path")

    ops = StackingOps()
    for family in FAMILIES:
        arch = parse_hf_config(hf_dict(family))
        model = model_class(arch)(arch, torch.float32)
        model.use_ops(ops)
        assert model.model.ops.ops is ops and model.model.step_path is None


def test_expert_load_counts_every_routed_row(checkpoints: Callable[[str], Checkpoint]) -> None:
    """Each MoE layer counts top_k rows per token computed: the prompts'
    tokens and every generated token but the last (never fed back)."""
    path, expected = checkpoints("qwen3_moe")
    loaded = load_model(ModelConfig(model=str(path), device="cpu", dtype="float32"))
    model = loaded.model
    assert isinstance(model, MoeForCausalLM)
    assert model.expert_load() == {0: [0] * 4, 2: [0] * 4}  # layer 1 is dense
    assert trio.run(lambda: serve(loaded)) == expected
    rows = sum(map(len, PROMPTS)) + len(PROMPTS) * (MAX_TOKENS - 1)
    load = model.expert_load(reset=True)
    assert {layer: sum(counts) for layer, counts in load.items()} == {0: 2 * rows, 2: 2 * rows}
    assert all(min(counts) > 0 for counts in load.values())
    assert model.expert_load() == {0: [0] * 4, 2: [0] * 4}


# -- GGUF ---------------------------------------------------------------------

#: Our family -> (its GGUF architecture, the checkpoint to convert).
GGUF_FAMILIES = {"qwen3_moe": ("qwen3moe", "qwen3_moe_gguf"), "mixtral": ("llama", "mixtral")}
GGUF_FAMILIES["olmoe"] = ("olmoe", "olmoe")
_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


_GGUF_STACKS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}


def write_moe_gguf(path: Path, hf_dir: Path, gguf_arch: str, *, stacked: int = 4) -> Path:
    """``hf_dir``'s checkpoint (4 experts) as llama.cpp's converter writes
    it: float32, each projection's first ``stacked`` experts stacked
    ``[stacked, ...]``, q/k rows permuted for the ``llama`` architecture."""
    import gguf
    from safetensors.torch import load_file

    from tests.models.test_loaders import llama_cpp_permute

    config = json.loads((hf_dir / "config.json").read_text())
    state = {k: v.numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_expert_count(4)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    stacks: dict[str, list[Any]] = {}
    for name, value in state.items():
        module, kind = name.rsplit(".", 1)
        if module in _GGUF_GLOBAL:
            writer.add_tensor(f"{_GGUF_GLOBAL[module]}.{kind}", value)
            continue
        _, _, layer, rest = module.split(".", 3)
        if ".experts." in rest:
            _, _, expert, proj = rest.split(".")
            stack = f"blk.{layer}.ffn_{_GGUF_STACKS.get(proj, 'down')}_exps.weight"
            stacks.setdefault(stack, [None] * 4)[int(expert)] = value
            continue
        if gguf_arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        writer.add_tensor(f"blk.{layer}.{_GGUF_BLOCK[rest]}.{kind}", value)
    for name, values in stacks.items():
        writer.add_tensor(name, np.stack(values[:stacked]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_greedy_equals_transformers(
    family: str, checkpoints: Callable[[str], Checkpoint], tmp_path: Path
) -> None:
    gguf_arch, source = GGUF_FAMILIES[family]
    hf_dir, expected = checkpoints(source)
    path = write_moe_gguf(tmp_path / f"{family}.gguf", hf_dir, gguf_arch)
    assert trio.run(lambda: serve(path)) == expected


def test_a_gguf_stack_of_other_experts_is_refused(
    checkpoints: Callable[[str], Checkpoint], tmp_path: Path
) -> None:
    hf_dir, _ = checkpoints("olmoe")
    path = write_moe_gguf(tmp_path / "olmoe.gguf", hf_dir, "olmoe", stacked=3)
    error = r"ffn_\w+_exps.weight. has shape \(3, \d+, \d+\), but the metadata implies 4 experts"
    with pytest.raises(ModelLoadError, match=error) as caught:
        load_model(ModelConfig(model=str(path), device="cpu"))
    assert "\n" not in str(caught.value)
