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
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models import memory
from asyncstep.models.gemma3 import Gemma3ForCausalLM
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.registry import model_class
from tests.models.test_hostile_files import as_rank

WINDOW = 8
MAX_TOKENS = 32
PROMPTS = [
    [3, 17, 92, 5, 250, 7, 7, 41, 99, 123, 8],
    [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31, 18, 77, 140, 3, 9, 21, 60, 2, 33],
    [77, 5, 9, 200, 14, 14, 150, 61, 8],
]
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

    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # sliding_window_pattern 6: layers 0-4 sliding, 5 full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        initializer_range=0.03,  # tied embeddings: larger ones repeat the last token
    )
    return transformers.Gemma3TextConfig(**(fields | changes))


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
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """The checkpoint (its norm offsets random, not transformers' zeros) and
    transformers' greedy tokens; those with every layer in full attention
    must differ."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(tiny_config()).eval()
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path, safe_serialization=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    expected = [hf_greedy(model.eval(), p) for p in PROMPTS]
    full = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", layer_types=["full_attention"] * 6
    ).eval()
    assert all(e != hf_greedy(full, p) for e, p in zip(expected, PROMPTS, strict=True))
    return path, expected


async def serve(path: Path, **options: Any) -> list[list[int]]:
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
def test_greedy_equals_transformers(checkpoint: Checkpoint, layout: str) -> None:
    path, expected = checkpoint
    assert trio.run(lambda: serve(path, **LAYOUTS[layout])) == expected


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
    for pp_rank in range(pp):
        with as_rank(0, tp, pp_rank, pp), torch.device("meta"):
            model = model_class(arch)(arch, torch.float32)
        built = sum(p.numel() for p in model.parameters())
        assert memory.rank_param_count(arch, tp_size=tp, pp_rank=pp_rank, pp_size=pp) == built
        assert model.expected_weight_names() <= set(arch.weight_shapes())


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
