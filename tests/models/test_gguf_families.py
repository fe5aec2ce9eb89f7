"""Gemma 3 and gpt-oss from GGUF files written as llama.cpp's converter
writes them (convert_hf_to_gguf.py), from tiny random transformers
checkpoints: tensors named by gguf-py's own map (``gguf.get_tensor_name_map``),
Gemma's norms stored as ``1 + w``, gpt-oss's interleaved gate / up experts
split into ``ffn_gate_exps`` / ``ffn_up_exps`` (or fused into
``ffn_gate_up_exps`` rows), its sinks as ``attn_sinks.weight``; metadata
only what the converter writes (llama.cpp hard-codes the rest). Greedy
tokens equal transformers', 32 tokens of 3 prompts longer than the sliding
window batched together, in fp32 on the CPU on one rank: Gemma 3 (five
sliding layers and a full one, tied embeddings, random norm offsets);
gpt-oss (sliding and full layers, YaRN, sinks, biased experts) with its
experts as MXFP4 blocks (ggml type 39, quantized by hand) and as float32
fused stacks.

MXFP4 blocks as ggml lays them out (scale byte, then value ``j`` in the low
nibble of byte ``j``, ``j + 16`` in its high nibble) dequantize to
:func:`asyncstep.models.mxfp4.dequantize_mxfp4`'s values of the same codes
in transformers' layout (even column low, odd high).

A Gemma 3 file without a window is full attention on one rotary; the load
estimate holds gpt-oss's gate and up stacks paired.

Then the door: a missing tensor or key, an unpaired or misshapen expert
stack, wrong sinks, a soft cap are refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.errors import ModelLoadError, UnsupportedModelError
from asyncstep.models.loader.gguf import GGUFCheckpoint
from asyncstep.models.loader.gguf_blocks import dequantize_blocks
from asyncstep.models.loader.hf import read_arch_config
from asyncstep.models.mxfp4 import dequantize_mxfp4
from tests.models.test_loaders import TINY_TOKENS

MAX_TOKENS = 32
PROMPTS = [
    [3, 17, 92, 5, 250, 7, 7, 41, 99, 123, 8],
    [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31, 18, 77, 140, 3, 9],
    [77, 5, 9, 200, 14, 14, 150, 61, 8],
]
HIDDEN, INTER, EXPERTS, HEAD_DIM = 64, 32, 4, 16
Checkpoint = tuple[Any, list[list[int]]]  # (the transformers model, its greedy tokens)
Tensors = dict[str, Any]  # GGUF name -> float32 array, or (raw bytes, ggml type)


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


async def serve(path: Path) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    results: list[list[int]] = [[] for _ in PROMPTS]
    async with asyncstep.open_engine(
        path, device="cpu", dtype="float32", engine_process=False
    ) as engine:

        async def one(i: int) -> None:
            results[i] = (await engine.generate(PROMPTS[i], params)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
    return results


# -- transformers' tiny models -------------------------------------------------------------


def gemma3_model() -> Any:
    """Five sliding layers (window 8) and a full one; the norms' offsets
    random (transformers' are zeros); ``query_pre_attn_scalar`` the head
    size (a GGUF carries none: llama.cpp takes the head size)."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        max_position_embeddings=256,
        sliding_window=8,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        initializer_range=0.03,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.5)
    return model


def gpt_oss_model() -> Any:
    """Sliding (window 4) and full layers, YaRN, random biases and sinks,
    experts of MXFP4 values (:func:`mxfp4_experts`)."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5, generator=g)
        for layer in model.model.layers:
            experts = layer.mlp.experts
            made = {proj: mxfp4_experts(g, *shape) for proj, shape in EXPERT_SHAPES.items()}
            experts.gate_up_proj[:, :, 0::2] = made["gate"][0].transpose(1, 2)
            experts.gate_up_proj[:, :, 1::2] = made["up"][0].transpose(1, 2)
            experts.down_proj.copy_(made["down"][0].transpose(1, 2))
            experts.ggml = {proj: raw for proj, (_, raw) in made.items()}  # for the GGUF
    return model


#: gpt-oss's expert stacks as GGUF holds them (rows, columns of each expert).
EXPERT_SHAPES = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}


def mxfp4_experts(g: torch.Generator, rows: int, cols: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random MXFP4 experts ``[E, rows, cols]``: their values (transformers'
    reference on transformers' layout) and ggml's MXFP4 bytes of the same
    codes and scales ``[E, rows, cols / 32 * 17]``."""
    groups = cols // 32
    codes = torch.randint(0, 16, (EXPERTS, rows, groups, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 125, (EXPERTS, rows, groups), generator=g, dtype=torch.uint8)
    hf_blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # even column low, odd high
    values = dequantize_mxfp4(hf_blocks, scales, torch.float32)
    ggml = torch.cat([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], dim=-1)
    return values, ggml.reshape(EXPERTS, rows, groups * 17).numpy()


@pytest.fixture(scope="module")
def gemma3() -> Checkpoint:
    model = gemma3_model()
    return model, [hf_greedy(model, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def gpt_oss() -> Checkpoint:
    model = gpt_oss_model()
    return model, [hf_greedy(model, p) for p in PROMPTS]


# -- the converter's files -----------------------------------------------------------------


def gguf_name(arch: gguf.MODEL_ARCH, layers: int) -> Callable[[str], str]:
    """gguf-py's name of a transformers tensor (module name, then its kind)."""
    names = gguf.get_tensor_name_map(arch, layers)

    def name(hf: str) -> str:
        module, kind = hf.rsplit(".", 1)
        if kind == "sinks":  # a parameter: the converter names it sinks.weight
            module, kind = hf, "weight"
        mapped = names.get_name(module)
        assert mapped is not None, hf
        return f"{mapped}.{kind}"

    return name


def write(path: Path, arch: str, config: Any, meta: dict[str, Any], tensors: Tensors) -> Path:
    """A GGUF of ``tensors`` and the metadata the converter writes (a tiny
    byte-level BPE vocabulary where ``meta`` asks for ``tokens``)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if meta.pop("tokens", False):
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(TINY_TOKENS)
        writer.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
        writer.add_token_merges(["a b", "Ġ a"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    for key, value in meta.items():
        if isinstance(value, int):
            writer.add_uint32(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_string(f"{arch}.{key}", value)
    for name, value in tensors.items():
        if isinstance(value, tuple):
            writer.add_tensor(name, value[0], raw_dtype=value[1])
        else:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gemma3_file(path: Path, model: Any, drop: str = "", **meta: Any) -> Path:
    """Gemma 3 as the converter writes it: norms ``1 + w``, tied (no ``output``)."""
    config = model.config
    name = gguf_name(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    tensors: Tensors = {}
    for hf, param in model.named_parameters():  # the tied lm_head is not named twice
        value = param.detach().numpy()
        tensors[name(hf)] = value + np.float32(1.0) if hf.endswith("norm.weight") else value
    tensors.pop(drop, None)
    rope = config.rope_parameters["full_attention"]
    metadata = {
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.sliding_window": config.sliding_window,
    }
    return write(path, "gemma3", config, metadata | meta, tensors)


def gpt_oss_file(
    path: Path, model: Any, *, mxfp4: bool = True, fused: bool = False, **meta: Any
) -> Path:
    """gpt-oss as the converter writes it: experts as MXFP4 bytes (their
    codes) or float32, gate and up split (or fused rows), down transposed."""
    config = model.config
    name = gguf_name(gguf.MODEL_ARCH.GPT_OSS, config.num_hidden_layers)
    tensors: Tensors = {}
    for hf, param in model.named_parameters():
        if ".mlp.experts." not in hf:
            tensors[name(hf)] = param.detach().numpy()
    mx = gguf.GGMLQuantizationType.MXFP4
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        blk = f"blk.{i}"
        gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], interleaved rows
        gate_up_bias = experts.gate_up_proj_bias.detach()
        stacks = {
            "gate": (gate_up[:, 0::2], gate_up_bias[:, 0::2]),
            "up": (gate_up[:, 1::2], gate_up_bias[:, 1::2]),
            "down": (experts.down_proj.detach().transpose(1, 2), experts.down_proj_bias.detach()),
        }
        for proj, (weight, bias) in stacks.items():
            tensors[f"{blk}.ffn_{proj}_exps.bias"] = bias.numpy()
            tensors[f"{blk}.ffn_{proj}_exps.weight"] = (
                (experts.ggml[proj], mx) if mxfp4 else weight.numpy()
            )
        if fused:
            for kind in ("weight", "bias"):
                gate = tensors.pop(f"{blk}.ffn_gate_exps.{kind}")
                up = tensors.pop(f"{blk}.ffn_up_exps.{kind}")
                tensors[f"{blk}.ffn_gate_up_exps.{kind}"] = np.concatenate((gate, up), axis=1)
    rope = config.rope_parameters
    metadata = {
        "rope.freq_base": float(rope["rope_theta"]),
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
        "rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
        "attention.sliding_window": config.sliding_window,
        "expert_count": EXPERTS,
        "expert_used_count": config.num_experts_per_tok,
        "expert_feed_forward_length": config.intermediate_size,
    }
    return write(path, "gpt-oss", config, metadata | meta, tensors)


# -- parity --------------------------------------------------------------------------------


def test_gemma3_gguf_greedy_equals_transformers(gemma3: Checkpoint, tmp_path: Path) -> None:
    model, expected = gemma3
    path = gemma3_file(tmp_path / "gemma3.gguf", model)
    assert trio.run(lambda: serve(path)) == expected


@pytest.mark.parametrize(
    "layout",
    [{"mxfp4": True}, {"mxfp4": False, "fused": True}],
    ids=["mxfp4 split stacks", "f32 fused gate_up"],
)
def test_gpt_oss_gguf_greedy_equals_transformers(
    gpt_oss: Checkpoint, layout: dict[str, bool], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 on the CPU: the MXFP4 stacks' experts are kept packed (every
    call of the library's experts takes MXFP4 weights), the float32 ones
    dense; transformers' tokens either way."""
    from asyncstep.ops.cpu.moe import CpuMoeExperts
    from asyncstep.ops.mxfp4 import Mxfp4Weight

    kinds: list[bool] = []
    original = CpuMoeExperts.__call__

    def counted(self: CpuMoeExperts, hidden: torch.Tensor, w13: Any, *args: Any) -> torch.Tensor:
        kinds.append(isinstance(w13, Mxfp4Weight))
        return original(self, hidden, w13, *args)

    monkeypatch.setattr(CpuMoeExperts, "__call__", counted)
    model, expected = gpt_oss
    path = gpt_oss_file(tmp_path / "gpt-oss.gguf", model, **layout)
    assert trio.run(lambda: serve(path)) == expected
    assert kinds and all(kind == layout["mxfp4"] for kind in kinds)


def test_the_configs_read_as_transformers_reads_them(
    gemma3: Checkpoint, gpt_oss: Checkpoint, tmp_path: Path
) -> None:
    """The fields llama.cpp hard-codes come out as the HF config's (the
    GGUFs carry no token ids; gpt-oss's MXFP4 stacks make an MXFP4 config,
    its HF original is unquantized)."""
    for name, (model, _), write_file in (
        ("gemma3", gemma3, gemma3_file),
        ("gpt_oss", gpt_oss, gpt_oss_file),
    ):
        model.save_pretrained(tmp_path / name, safe_serialization=True)
        theirs = read_arch_config(tmp_path / name)
        ours = GGUFCheckpoint(write_file(tmp_path / f"{name}.gguf", model)).arch_config()
        assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)  # a float32 key
        same = dict(eos_token_ids=(), bos_token_id=None, rms_norm_eps=theirs.rms_norm_eps)
        assert ours.experts_mxfp4 == (name == "gpt_oss")
        same["experts_mxfp4"] = ours.experts_mxfp4
        assert ours.replace(**same) == theirs.replace(**same), name


def test_gemma3_without_a_window_is_full_attention_on_one_rotary(
    gemma3: Checkpoint, tmp_path: Path
) -> None:
    """As llama.cpp reads such a file (the converter writes none for
    ``sliding_window_pattern`` 1); a ``rope.freq_base_swa`` key is the
    sliding layers' base where there are some."""
    path = gemma3_file(tmp_path / "full.gguf", gemma3[0], **{"attention.sliding_window": 0})
    config = GGUFCheckpoint(path).arch_config()
    assert config.layer_windows == (None,) * 6 and not config.layer_types
    assert config.rope_local_base_freq is None
    path = gemma3_file(tmp_path / "swa.gguf", gemma3[0], **{"rope.freq_base_swa": 5000.0})
    config = GGUFCheckpoint(path).arch_config()
    assert config.layer_windows == (8, 8, 8, 8, 8, None)
    assert config.rope_local_base_freq == 5000.0


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_the_tokenizer_loads(
    family: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers converts a ``gemma3`` or ``gpt-oss`` file's tokenizer."""
    monkeypatch.setenv("ASYNCSTEP_CACHE_DIR", str(tmp_path / "cache"))
    model = request.getfixturevalue(family)[0]
    write_file = gemma3_file if family == "gemma3" else gpt_oss_file
    checkpoint = GGUFCheckpoint(write_file(tmp_path / "t.gguf", model, tokens=True))
    tokenizer = checkpoint.load_tokenizer()
    assert tokenizer("ab a").input_ids[-2:] == [TINY_TOKENS.index("ab"), TINY_TOKENS.index("Ġa")]
    assert checkpoint.arch_config().eos_token_ids == (2,)


def test_mxfp4_blocks_dequantize_as_the_reference() -> None:
    """ggml's MXFP4 bytes of some codes and scales (every scale 0..254, every
    code) give the reference's values of the same codes in transformers'
    layout, through the loader's torch path and gguf-py's alike."""
    g = torch.Generator().manual_seed(3)
    values, raw = mxfp4_experts(g, 255, 64)
    codes = torch.arange(32, dtype=torch.uint8) % 16
    scales = torch.arange(255, dtype=torch.uint8)
    hf_blocks = (codes[0::2] | (codes[1::2] << 4)).expand(255, 16)[:, None]
    reference = dequantize_mxfp4(hf_blocks.contiguous(), scales[:, None], torch.float32)
    ggml = torch.cat([scales[:, None], (codes[:16] | (codes[16:] << 4)).expand(255, 16)], 1)
    mx = int(gguf.GGMLQuantizationType.MXFP4)
    for ours, expected in (
        (dequantize_blocks(ggml.numpy(), mx), reference),
        (dequantize_blocks(raw, mx), values),
    ):
        assert ours is not None and torch.equal(ours, expected.reshape(-1))
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(
        torch.from_numpy(np.ascontiguousarray(theirs)).reshape(-1), values.reshape(-1)
    )


# -- the door ------------------------------------------------------------------------------


def refused(cls: type[Exception], path: Path, match: str) -> None:
    with pytest.raises(cls, match=match) as caught:
        GGUFCheckpoint(path)
    assert type(caught.value) is cls and "\n" not in str(caught.value)


def test_a_gemma3_file_lacking_a_norm_is_refused(gemma3: Checkpoint, tmp_path: Path) -> None:
    path = gemma3_file(tmp_path / "g.gguf", gemma3[0], drop="blk.2.post_ffw_norm.weight")
    refused(ModelLoadError, path, r"lacks 1 of the tensors .* model\.layers\.2\.post_feedforward")


def test_a_gemma3_soft_cap_is_refused(gemma3: Checkpoint, tmp_path: Path) -> None:
    path = gemma3_file(tmp_path / "g.gguf", gemma3[0], final_logit_softcapping=30.0)
    refused(UnsupportedModelError, path, "unsupported option final_logit_softcapping")


#: (the change, the error class, its message).
HOSTILE_GPT_OSS = [
    ("no window", ModelLoadError, "GGUF metadata lacks gpt-oss.attention.sliding_window"),
    ("no up stack", ModelLoadError, r"'blk.1.ffn_gate_exps.bias' has no ffn_up_exps.bias"),
    ("no gate stack", ModelLoadError, r"'blk.0.ffn_up_exps.weight' has no ffn_gate_exps"),
    ("odd up stack", ModelLoadError, r"'blk.0.ffn_up_exps.weight' has \(4, 16, 64\)"),
    ("odd down stack", ModelLoadError, r"'blk.3.ffn_down_exps.weight' has shape \(4, 64\)"),
    ("sinks", ModelLoadError, r"'blk.0.attn_sinks.weight' has shape \(3,\), but .* \(4,\)"),
    ("a dense MLP", ModelLoadError, "'blk.0.ffn_gate.weight' has no place in the model"),
]


@pytest.mark.parametrize(
    ("change", "cls", "error"), HOSTILE_GPT_OSS, ids=[row[0] for row in HOSTILE_GPT_OSS]
)
def test_hostile_gpt_oss_files_are_refused_in_one_line(
    gpt_oss: Checkpoint, tmp_path: Path, change: str, cls: type[Exception], error: str
) -> None:
    model = gpt_oss[0]
    path = gpt_oss_file(tmp_path / "ok.gguf", model, mxfp4=False)
    reader = gguf.GGUFReader(path)
    tensors: Tensors = {t.name: np.array(t.data) for t in reader.tensors}
    meta: dict[str, Any] = {}
    if change == "no window":
        meta = {"attention.sliding_window": None}
    elif change == "no up stack":
        del tensors["blk.1.ffn_up_exps.bias"]
    elif change == "no gate stack":
        del tensors["blk.0.ffn_gate_exps.weight"]
    elif change == "odd up stack":
        tensors["blk.0.ffn_up_exps.weight"] = tensors["blk.0.ffn_up_exps.weight"][:, :16]
    elif change == "odd down stack":
        tensors["blk.3.ffn_down_exps.weight"] = tensors["blk.3.ffn_down_exps.weight"][:, :, 0]
    elif change == "sinks":
        tensors["blk.0.attn_sinks.weight"] = tensors["blk.0.attn_sinks.weight"][:3]
    else:
        tensors["blk.0.ffn_gate.weight"] = np.zeros((INTER, HIDDEN), np.float32)
    refused(cls, rewrite(tmp_path / "bad.gguf", reader, tensors, meta), error)


def rewrite(path: Path, reader: gguf.GGUFReader, tensors: Tensors, meta: dict[str, Any]) -> Path:
    """``reader``'s file with ``tensors`` and its ``gpt-oss.*`` keys, those
    in ``meta`` changed (None: left out)."""
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    for key, field in reader.fields.items():
        short = key.removeprefix("gpt-oss.")
        if short == key or field.types[0] == gguf.GGUFValueType.ARRAY:
            continue
        value = meta.get(short, field.contents())
        if value is not None:
            writer.add_key_value(key, value, field.types[0])
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_load_estimate_holds_gpt_oss_gate_and_up_stacks_paired() -> None:
    """gpt-oss-120b's shape (gpt-oss-20b's with 36 layers of 128 experts):
    its largest tensor in flight is a layer's gate and up experts together
    (the GGUF's two stacks interleaved, as transformers' one
    ``gate_up_proj``), three float32 copies alive."""
    from asyncstep.models.dummy import SHAPES
    from asyncstep.models.memory import CHECKPOINT_LOADING_COPIES, model_memory

    arch = SHAPES["gpt-oss-20b"].replace(num_experts=128, num_hidden_layers=36)
    gate_up = arch.num_experts * 2 * arch.moe_intermediate_size * arch.hidden_size
    loading = model_memory(arch, torch.bfloat16).loading
    assert loading == gate_up * 4 * CHECKPOINT_LOADING_COPIES == 25_480_396_800
