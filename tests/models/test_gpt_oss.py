"""gpt-oss from a tiny random checkpoint written with transformers'
``save_pretrained`` (safetensors, unquantized): greedy tokens equal
transformers' (eager attention with sinks), 32 tokens of 3 prompts longer
than its sliding window of 4, batched, in fp32 on the CPU, on one rank
(whole prompts and chunked prefill; the CPU library's attention kernel,
which takes the sinks itself: its calls with sinks counted, and the torch
attention backend) and with
PP = 2 x TP = 2 in one 4-rank engine (gloo). Its layers alternate sliding
and full attention, its rope is YaRN, its router is biased and softmaxes
its top-k logits, its experts are biased swigluoai. The same model with
MXFP4 experts (``_blocks`` / ``_scales`` uint8 tensors and an MXFP4
``quantization_config``, as the released checkpoints) loads to
transformers' tokens on its dequantized weights: its experts kept packed
(the CPU library's MXFP4 kernel takes them: counted; 4.25 bits a value
held) and, with packing off, dequantized at load. The window matters
(full attention gives other tokens); each layer's MoE block gives
transformers' ``GptOssMLP``'s rows, op by op.

Then the door: hostile gpt-oss config fields are refused in one line,  another
quantization is refused, the Triton op sets honour sinks (their kernels'
tests: ``tests/gpu/test_triton_sinks.py``), the CPU decode stack declines
its layers (mixtures of experts), the memory estimate counts
its parameters; the ``gpt-oss-20b``
dummy preset's config (not allocated)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.gpt_oss import GptOssForCausalLM
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.mxfp4 import dequantize_mxfp4
from tests.models.hf_parity import (
    Checkpoint,
    Parity,
    hf_greedy,
    moe_block_differences,
    random_model,
    tiny_fields,
)

PROMPTS = [
    [3, 17, 92, 5, 44, 61, 2, 9, 130],
    [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31],
    [77, 1, 180, 33, 4, 58],
]
PARITY = Parity(PROMPTS)
WINDOW = 4


def tiny_config(**changes: Any) -> Any:
    import transformers

    fields = tiny_fields(
        intermediate_size=32,
        num_hidden_layers=4,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    )
    config = transformers.GptOssConfig(**(fields | changes))
    config._attn_implementation = "eager"
    return config


def tiny_model(**changes: Any) -> Any:
    model = random_model(tiny_config(**changes))
    with torch.no_grad():  # biases are zeros at init: make them count
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return PARITY.save(tiny_model(), tmp_path_factory.mktemp("gpt_oss"))


def random_mxfp4(g: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks and scales of a ``[..., rows, cols]`` projection."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 125, (*lead, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The tiny model with MXFP4 experts: transformers runs their
    dequantized values; the checkpoint holds them packed."""
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    packed: dict[str, torch.Tensor] = {}
    experts, hidden, inter = 4, 64, 32
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}.mlp.experts"
            for proj, rows, cols in (
                ("gate_up_proj", 2 * inter, hidden),
                ("down_proj", hidden, inter),
            ):
                blocks, scales = random_mxfp4(g, experts, rows, cols)
                dense = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2)
                getattr(layer.mlp.experts, proj).copy_(dense)
                packed |= {f"{prefix}.{proj}_blocks": blocks, f"{prefix}.{proj}_scales": scales}
    path, expected = PARITY.save(model, tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    tensors = load_file(path / "model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.endswith(("gate_up_proj", "down_proj"))}
    save_file(tensors | packed, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(config))
    return path, expected


def test_the_checkpoint_reads_as_gpt_oss(checkpoint: Checkpoint) -> None:
    from asyncstep.models.loader.hf import read_arch_config

    arch = read_arch_config(checkpoint[0])
    assert arch.family == "gpt_oss" and arch.attention_sinks and arch.attention_bias
    assert arch.layer_windows == (WINDOW, None, WINDOW, None)
    assert arch.scoring_func == "topk_softmax" and arch.moe_activation == "swigluoai"
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "yarn"
    assert all(len(p) > WINDOW for p in PROMPTS)
    # The window matters: the same weights in full attention give the
    # longest prompt other tokens.
    full = AutoModelForCausalLM.from_pretrained(
        checkpoint[0], attn_implementation="eager", layer_types=["full_attention"] * 4
    ).eval()
    assert hf_greedy(full, PROMPTS[1]) != checkpoint[1][1]


@pytest.mark.parametrize(
    "layout",
    [
        {},
        {"max_num_batched_tokens": 4},
        {"attention_backend": "torch"},
        {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    ],
    ids=["one rank", "one rank, chunked prefill", "one rank, torch attention", "pp2xtp2"],
)
def test_greedy_equals_transformers(
    checkpoint: Checkpoint, layout: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstep.ops.cpu.attention import CpuPagedAttention

    calls_with_sinks = []
    original = CpuPagedAttention.__call__

    def counted(self: CpuPagedAttention, *args: Any, **kwargs: Any) -> None:
        calls_with_sinks.append(kwargs.get("sinks") is not None)
        original(self, *args, **kwargs)

    monkeypatch.setattr(CpuPagedAttention, "__call__", counted)
    path, expected = checkpoint
    assert PARITY.serve(path, **layout) == expected
    if layout in ({}, {"max_num_batched_tokens": 4}):  # one rank, in this process
        assert calls_with_sinks and all(calls_with_sinks)
    elif layout == {"attention_backend": "torch"}:
        assert not calls_with_sinks


def test_each_moe_block_equals_transformers(checkpoint: Checkpoint) -> None:
    """Op by op: each layer's block (the biased router's softmax over its
    top-k logits, the biased swigluoai experts) on random rows gives
    transformers' ``GptOssMLP``'s rows."""
    differences = moe_block_differences(checkpoint[0])
    assert len(differences) == 4 and max(differences) < 1e-6, differences


@pytest.mark.parametrize("packed", [True, False], ids=["kept packed", "dequantized"])
def test_mxfp4_experts_give_transformers_tokens(
    mxfp4_checkpoint: Checkpoint, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank, fp32 on the CPU: the experts kept MXFP4 (every call of
    the library's experts takes packed weights) or, packing off, dequantized
    at load (dense float32 weights): transformers' tokens either way."""
    from asyncstep.models.loader.hf import read_arch_config
    from asyncstep.ops.cpu.moe import CpuMoeExperts
    from asyncstep.ops.mxfp4 import Mxfp4Weight

    path, expected = mxfp4_checkpoint
    assert read_arch_config(path).experts_mxfp4
    monkeypatch.setattr(GptOssForCausalLM, "mxfp4_packed", packed)
    kinds: list[bool] = []
    original = CpuMoeExperts.__call__

    def counted(self: CpuMoeExperts, hidden: torch.Tensor, w13: Any, *args: Any) -> torch.Tensor:
        kinds.append(isinstance(w13, Mxfp4Weight))
        return original(self, hidden, w13, *args)

    monkeypatch.setattr(CpuMoeExperts, "__call__", counted)
    assert PARITY.serve(path) == expected
    assert kinds and all(kind == packed for kind in kinds)


def test_mxfp4_experts_held_packed_take_their_bytes(mxfp4_checkpoint: Checkpoint) -> None:
    """Loaded on the CPU in float32: each layer's experts hold their codes
    and scales (mxfp4_bytes of their values), the dense parameters empty;
    the reference op set dequantizes them at its first forward, to the
    values dequantize_mxfp4 gives."""
    from asyncstep.models.hf_config import parse_hf_config as parse
    from asyncstep.models.mxfp4 import mxfp4_bytes
    from asyncstep.ops.torch_ref import TorchOps

    path, _ = mxfp4_checkpoint
    arch = parse(json.loads((path / "config.json").read_text()))
    model = GptOssForCausalLM(arch)
    tensors = load_file(path / "model.safetensors")
    assert model.load_weights(tensors.items()) == model.expected_weight_names()
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_mxfp4 is not None and experts.w2_mxfp4 is not None
    assert experts.w13_weight.numel() == 0 and experts.w2_weight.numel() == 0
    values = 4 * (2 * 32 * 64 + 64 * 32)
    assert experts.w13_mxfp4.nbytes + experts.w2_mxfp4.nbytes == mxfp4_bytes(values)
    blocks = tensors["model.layers.0.mlp.experts.down_proj_blocks"]
    scales = tensors["model.layers.0.mlp.experts.down_proj_scales"]
    from asyncstep.models.gpt_oss import keeps_mxfp4_experts
    from asyncstep.models.memory import model_memory

    cpu = torch.device("cpu")
    assert keeps_mxfp4_experts(arch, torch.float32, cpu, 1, 1)
    assert not keeps_mxfp4_experts(arch, torch.float32, cpu, 2, 1)  # a TP slice of 16 columns
    assert not keeps_mxfp4_experts(arch, torch.bfloat16, cpu, 1, 1)
    held = sum(p.nbytes for p in model.parameters()) + sum(
        m.mlp.experts.w13_mxfp4.nbytes + m.mlp.experts.w2_mxfp4.nbytes for m in model.model.layers
    )
    assert model_memory(arch, torch.float32, mxfp4_experts=True).weights == held
    model.use_ops(TorchOps())
    model.model.layers[0].mlp(torch.randn(3, 64))
    assert experts.w2_mxfp4 is None
    assert torch.equal(experts.w2_weight, dequantize_mxfp4(blocks, scales, torch.float32))


def test_mxfp4_experts_of_a_bfloat16_cpu_model_are_dequantized_once(
    mxfp4_checkpoint: Checkpoint,
) -> None:
    """Built float32 on the CPU (packed), cast to bfloat16 as the loader
    does: the CPU op set's first forward dequantizes them to bfloat16."""
    from asyncstep.models.hf_config import parse_hf_config as parse
    from asyncstep.models.model_loader import settle_dtype
    from asyncstep.ops.select import select_ops

    path, _ = mxfp4_checkpoint
    model = GptOssForCausalLM(parse(json.loads((path / "config.json").read_text())))
    tensors = load_file(path / "model.safetensors")
    model.load_weights(tensors.items())
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_mxfp4 is not None
    settle_dtype(model, torch.bfloat16)
    ops = select_ops(torch.device("cpu"), "cpu", fused_kernels=True)
    assert getattr(ops, "takes_mxfp4_experts", False)
    model.use_ops(ops)
    model.model.layers[1].mlp(torch.randn(3, 64, dtype=torch.bfloat16))
    blocks = tensors["model.layers.1.mlp.experts.down_proj_blocks"]
    scales = tensors["model.layers.1.mlp.experts.down_proj_scales"]
    assert experts.w13_mxfp4 is None and experts.w2_mxfp4 is None
    assert torch.equal(experts.w2_weight, dequantize_mxfp4(blocks, scales, torch.bfloat16))


# -- the door -----------------------------------------------------------------


def hf_dict(**changes: Any) -> dict[str, Any]:
    config = tiny_config().to_dict()
    config["architectures"] = ["GptOssForCausalLM"]
    config.update(changes)
    return config


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"num_local_experts": 0}, r"num_local_experts must be in \[1, 1024\], got 0"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok must be in \[1, 4\], got 9"),
        ({"sliding_window": -1}, "sliding_window must be in"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types names 3 layers"),
        ({"layer_types": "full"}, "layer_types must be a list"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "lacks original_max"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "beta_fast": "x",
                    "original_max_position_embeddings": 64,
                }
            },
            "beta_fast must be",
        ),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "truncate": 1,
                    "original_max_position_embeddings": 64,
                }
            },
            "truncate must be true or false",
        ),
    ],
)
def test_hostile_gpt_oss_configs_are_refused_in_one_line(
    changes: dict[str, Any], error: str
) -> None:
    with pytest.raises(ModelLoadError, match=error) as caught:
        parse_hf_config(hf_dict(**changes))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization 'fp8'"),
        ({"swiglu_limit": 10.0}, "swiglu_limit 10.0"),
        ({"swiglu_alpha": "1.702"}, "swiglu_alpha '1.702'"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer type 'chunked_attention'"),
    ],
)
def test_unsupported_gpt_oss_options_are_named(changes: dict[str, Any], error: str) -> None:
    with pytest.raises(UnsupportedModelError, match=error) as caught:
        parse_hf_config(hf_dict(**changes))
    assert "\n" not in str(caught.value)


def test_op_sets_without_sinks_are_refused_and_the_decode_stack_declines() -> None:
    """An attention op without sinks is refused at load; the Triton ones
    have them."""
    from asyncstep.models.memory import rank_param_count
    from asyncstep.ops.cpu.decode_stack import CpuDecodeStack
    from asyncstep.ops.cpu.library import load_cpu_kernels
    from asyncstep.ops.torch_attention import TorchAttention
    from asyncstep.ops.torch_ref import TorchOps
    from asyncstep.ops.triton.invariant_attention import TritonInvariantAttention
    from asyncstep.ops.triton.paged_attention import TritonAttention

    arch = parse_hf_config(hf_dict())
    model = GptOssForCausalLM(arch)
    assert rank_param_count(arch) == sum(p.numel() for p in model.parameters())
    assert all(layer.self_attn.attn.shape.sinks is not None for layer in model.model.layers)

    class NoSinks(TorchAttention):
        name = "no-sinks"
        supports_sinks = False

    with pytest.raises(UnsupportedModelError, match="'no-sinks' attention op does not support"):
        model.use_ops(TorchOps(NoSinks()))
    assert TritonAttention.supports_sinks and TritonInvariantAttention.supports_sinks
    model.use_ops(TorchOps(TorchAttention()))
    assert model.model.step_path is None
    kernels = load_cpu_kernels()
    if kernels is not None:
        assert CpuDecodeStack.build(kernels, model.model.stage_layers()) is None


def test_dummy_weights_of_mxfp4_experts_load() -> None:
    from asyncstep.models.dummy import dummy_weights

    arch = parse_hf_config(hf_dict(quantization_config={"quant_method": "mxfp4"}))
    model = GptOssForCausalLM(arch)
    assert model.load_weights(dummy_weights(arch)) == model.expected_weight_names()
    w13 = model.model.layers[0].mlp.experts.w13_mxfp4  # kept packed: float32 on the CPU
    assert w13 is not None and 0 < float(w13.dequantize().abs().max()) <= 6 * 2.0**-4


def test_the_gpt_oss_20b_preset() -> None:
    from asyncstep.models.dummy import get_shape

    arch = get_shape("gpt-oss-20b")
    arch.validate()
    assert (arch.num_hidden_layers, arch.num_experts, arch.num_experts_per_tok) == (24, 32, 4)
    assert arch.layer_windows[:2] == (128, None) and arch.attention_sinks
    shapes = arch.weight_shapes()
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (32, 2880, 5760)
    assert shapes["model.layers.0.self_attn.sinks"] == (64,)
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 20.5e9 < params < 21.5e9  # transformers counts 20.9e9


def test_misshapen_mxfp4_experts_are_refused_in_one_line(mxfp4_checkpoint: Checkpoint) -> None:
    """Blocks of too few rows, or blocks that do not match their scales,
    kept packed: a one-line ModelLoadError naming the projection."""
    from asyncstep.models.hf_config import parse_hf_config as parse

    path, _ = mxfp4_checkpoint
    arch = parse(json.loads((path / "config.json").read_text()))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    cases = [
        (torch.zeros(4, 32, 2, 16, dtype=torch.uint8), torch.zeros(4, 32, 2, dtype=torch.uint8),
         r"MXFP4 experts w13: shape \(4, 32, 64\) does not match the model's \(4, 64, 64\)"),
        (torch.zeros(4, 64, 2, 8, dtype=torch.uint8), torch.zeros(4, 64, 2, dtype=torch.uint8),
         r"gate_up_proj: mxfp4: blocks \(4, 64, 2, 8\) must be scales"),
    ]  # fmt: skip
    for blocks, scales, error in cases:
        model = GptOssForCausalLM(arch)
        with pytest.raises(ModelLoadError, match=error) as caught:
            model.load_weights([(f"{name}_blocks", blocks), (f"{name}_scales", scales)])
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tp_rank_s_packed_slice_is_its_dense_slice(rank: int) -> None:
    """``FusedMoE.load_mxfp4`` on TP rank ``rank`` of 2 (I 128: 64 columns
    a rank, whole blocks): the packed slice dequantized is what the dense
    loader (``_load_stacked``) puts in that rank's parameters from the same
    values, gate rows then up rows."""
    from asyncstep.models.layers.moe import FusedMoE
    from asyncstep.ops.mxfp4 import Mxfp4Weight

    def experts_of_rank() -> FusedMoE:
        experts = FusedMoE(2, 64, 64, bias=True, activation="swigluoai")
        experts.tp_rank, experts.tp_size = rank, 2  # this rank's I is 64 of 128
        return experts

    g = torch.Generator().manual_seed(2)
    w13_parts = random_mxfp4(g, 2, 256, 64)  # [E, 2I, H], gate and up rows interleaved
    w2_parts = random_mxfp4(g, 2, 64, 128)  # [E, H, I]
    packed, dense = experts_of_rank(), experts_of_rank()
    assert packed.takes_mxfp4()
    packed.load_mxfp4("w13", Mxfp4Weight.from_checkpoint(*w13_parts))
    packed.load_mxfp4("w2", Mxfp4Weight.from_checkpoint(*w2_parts))
    w13 = dequantize_mxfp4(*w13_parts, torch.float32)
    w2 = dequantize_mxfp4(*w2_parts, torch.float32)
    dense._load_stacked(dense.w13_weight, w13.transpose(1, 2), "w13_interleaved")
    dense._load_stacked(dense.w2_weight, w2.transpose(1, 2), "w2")
    assert packed.w13_mxfp4 is not None and packed.w2_mxfp4 is not None
    assert torch.equal(packed.w13_mxfp4.dequantize(), dense.w13_weight)
    assert torch.equal(packed.w2_mxfp4.dequantize(), dense.w2_weight)
