"""Gemma 3's text model (``Gemma3ForCausalLM``) from a tiny random checkpoint
written with transformers' ``save_pretrained`` (safetensors): five sliding
layers (window 8) and a full one, tied embeddings, random norm offsets and
a ``query_pre_attn_scalar`` other than ``head_dim``. Greedy tokens equal
transformers' (eager attention), 32 tokens of 3 prompts longer than the
window batched together, in fp32 on the CPU: on one rank (whole prompts;
chunked prefill over blocks of 4 tokens), and with PP = 2 x TP = 2 under
sequence parallelism (gloo, a process per rank). The checkpoint's tokens
with every layer in full attention differ (the window matters).

Then the door: hostile Gemma fields are refused with one line, unsupported
options (soft caps, bidirectional attention, a scaled sliding rope) named;
a config in transformers 4.x's spelling reads as transformers 5 reads it;
the memory estimate counts every parameter each rank builds; no op set's
whole-stack step path is asked for."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.gemma3 import Gemma3ForCausalLM
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.registry import model_class
from tests.models.hf_parity import LONG_PROMPTS, Checkpoint, Parity, random_model, tiny_fields
from tests.models.test_hostile_files import assert_each_rank_builds_the_estimate

WINDOW = 8
PARITY = Parity(LONG_PROMPTS)
LAYOUTS: dict[str, dict[str, Any]] = {
    "one rank": {},
    "one rank, chunked prefill, small blocks": {"max_num_batched_tokens": 5, "block_size": 4},
    "pp2xtp2, sequence parallel": {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 2,
        "sequence_parallel": True,
    },
}


def tiny_config(**changes: Any) -> Any:
    import transformers

    fields = tiny_fields(
        intermediate_size=128,
        num_hidden_layers=6,  # sliding_window_pattern 6: layers 0-4 sliding, 5 full
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        initializer_range=0.03,  # tied embeddings: larger ones repeat the last token
        tie_word_embeddings=True,
    )
    return transformers.Gemma3TextConfig(**(fields | changes))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The checkpoint (its norm offsets random, not transformers' zeros) and
    transformers' greedy tokens; those with every layer in full attention
    must differ."""
    import transformers

    model = random_model(tiny_config(), attn_implementation="eager")
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.normal_(0, 0.5)
    path, expected = PARITY.save(model, tmp_path_factory.mktemp("gemma3"))
    full = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", layer_types=["full_attention"] * 6
    ).eval()
    assert all(e != f for e, f in zip(expected, PARITY.expected(full), strict=True))
    return path, expected


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_equals_transformers(checkpoint: Checkpoint, layout: str) -> None:
    path, expected = checkpoint
    assert PARITY.serve(path, **LAYOUTS[layout]) == expected


def test_the_norms_hold_one_plus_the_offsets_through_the_packed_cache(
    checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bfloat16 CPU model keeps its norms in float32 as ``1 + w``; the
    packed cache's entry (the state dict) gives the next load the same."""
    from safetensors.torch import load_file

    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model

    monkeypatch.setenv("ASYNCSTEP_CACHE_DIR", str(tmp_path))
    path, _ = checkpoint
    offsets = {n: w for n, w in load_file(path / "model.safetensors").items() if "norm" in n}
    config = ModelConfig(model=str(path), device="cpu", dtype="bfloat16")
    for _ in range(2):
        state = load_model(config, with_tokenizer=False).model.state_dict()
        for name, offset in offsets.items():
            assert state[name].dtype == torch.float32
            assert torch.equal(state[name], offset.float() + 1), name
    assert list(tmp_path.rglob("*.safetensors")), "no packed cache entry written"


# -- the door -----------------------------------------------------------------


def hf_dict(**changes: Any) -> dict[str, Any]:
    config = tiny_config().to_dict()
    config["architectures"] = ["Gemma3ForCausalLM"]
    return config | changes


def test_the_config_reads_as_transformers_reads_it() -> None:
    arch = parse_hf_config(hf_dict())
    assert arch.family == "gemma3" and arch.tie_word_embeddings and arch.qk_norm
    assert arch.layer_windows == (WINDOW,) * 5 + (None,)
    assert (arch.rope_theta, arch.rope_local_base_freq) == (1e6, 1e4)
    assert arch.attention_scale == 24**-0.5 and arch.hidden_act == "gelu_pytorch_tanh"
    assert "model.layers.5.pre_feedforward_layernorm.weight" in arch.weight_shapes()


def test_a_transformers_4_config_reads_as_transformers_5_reads_it() -> None:
    """4.x's ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` and
    ``sliding_window_pattern`` (no ``layer_types``, no tie field: tied)."""
    import transformers

    old: dict[str, Any] = {
        k: v for k, v in hf_dict().items() if k not in ("rope_parameters", "layer_types")
    }
    old.pop("tie_word_embeddings")
    old |= {
        "rope_theta": 5e5,
        "rope_local_base_freq": 2e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 3,
    }
    ours = parse_hf_config(old)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "architectures"})
    assert list(ours.layer_types) == theirs.layer_types
    rope = theirs.rope_parameters
    full, local = rope["full_attention"], rope["sliding_attention"]
    assert ours.rope_theta == full["rope_theta"] and ours.rope_scaling == {
        k: v for k, v in full.items() if k != "rope_theta"
    }
    assert ours.rope_local_base_freq == local["rope_theta"] and ours.tie_word_embeddings


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"query_pre_attn_scalar": "256"}, "query_pre_attn_scalar must be a finite number"),
        ({"query_pre_attn_scalar": -1}, r"query_pre_attn_scalar must be in \(0, inf\], got -1"),
        ({"query_pre_attn_scalar": math.nan}, "query_pre_attn_scalar must be a finite number"),
        ({"rope_parameters": {"sliding_attention": {"rope_theta": 0}}}, "rope_local_base_freq"),
        ({"rope_parameters": {"full_attention": []}}, "rope_parameters must map layer types"),
        ({"hidden_activation": ["gelu"] * 1000}, "unsupported activation"),
        ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping must be a finite number"),
        ({"final_logit_softcapping": math.inf}, "final_logit_softcapping must be a finite number"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types names 5 layers"),
        ({"layer_types": None, "sliding_window_pattern": 0}, "sliding_window_pattern must be in"),
        ({"sliding_window": -8}, "sliding_window must be in"),
    ],
)
def test_hostile_gemma_configs_are_refused_in_one_line(changes: dict[str, Any], error: str) -> None:
    with pytest.raises(ModelLoadError, match=error) as info:
        parse_hf_config(hf_dict(**changes))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"final_logit_softcapping": 30.0}, "unsupported option final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "unsupported option attn_logit_softcapping"),
        ({"hidden_activation": "silu"}, "unsupported activation 'silu' for Gemma3ForCausalLM"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "unsupported sliding-layer rope 'linear'",
        ),
    ],
)
def test_unsupported_gemma_options_are_named(changes: dict[str, Any], error: str) -> None:
    with pytest.raises(UnsupportedModelError, match=error):
        parse_hf_config(hf_dict(**changes))


def test_other_families_take_no_gemma_fields() -> None:
    arch = parse_hf_config(hf_dict())
    llama = arch.replace(architecture="LlamaForCausalLM", hidden_act="silu")
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM takes no Gemma fields"):
        llama.validate()


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 3)])
def test_estimate_is_the_parameters_each_rank_builds(tp: int, pp: int) -> None:
    """The memory estimate counts the sandwich norms; every parameter has a
    checkpoint name the config expects."""
    arch = parse_hf_config(hf_dict())
    assert_each_rank_builds_the_estimate(arch, tp, pp)


def test_gemma_asks_no_op_set_for_a_step_path() -> None:
    """The whole-stack paths (the CPU's decode stack, Triton's fused decode)
    read Llama layers: a Gemma model runs layer by layer on every op set."""
    from asyncstep.ops.torch_ref import TorchOps

    class StackingOps(TorchOps):
        def step_path(self, layers: list[Any]) -> Any:
            raise AssertionError("a Gemma model asked for a step path")

    arch = parse_hf_config(hf_dict())
    model = model_class(arch)(arch, torch.float32)
    assert isinstance(model, Gemma3ForCausalLM)
    ops = StackingOps()
    model.use_ops(ops)
    assert model.model.ops.ops is ops and model.model.step_path is None


def test_the_gemma3_1b_preset() -> None:
    """The dummy shape is google/gemma-3-1b-it's text model: every sixth
    layer full, the rest windowed (13 KV cache groups of 2 layers)."""
    from asyncstep.kv_cache_interface import kv_cache_groups
    from asyncstep.models.dummy import get_shape

    arch = get_shape("gemma3-1b")
    arch.validate()
    assert arch.is_gemma and arch.tie_word_embeddings
    assert arch.layer_windows[4:7] == (512, None, 512) and arch.layer_windows.count(None) == 4
    assert len(kv_cache_groups(arch.layer_windows)) == 13
    params = sum(torch.Size(s).numel() for s in arch.weight_shapes().values())
    assert 0.95e9 < params < 1.05e9  # transformers counts 1.0e9 (tied embeddings)
