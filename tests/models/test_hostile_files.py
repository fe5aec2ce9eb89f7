"""No model file can exhaust the machine: hostile GGUF files, safetensors files,
HF ``config.json`` files and dummy shapes are refused with a one-line
ModelLoadError (UnsupportedModelError where the file is well-formed but
unsupported), within 5 s and under 1 GB of peak RSS.

The files are written here (tiny valid models, then each broken one way); one
subprocess loads them all through ``load_model``, each after resetting its
peak RSS (``/proc/self/clear_refs``), and reports per case the error, the time
and the peak (``VmHWM``). A control case of each format must still load.
Also, in process: the memory estimate against the parameters a model builds,
and refusals when memory is short (model, KV cache).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from asyncstep.channels import GroupCoordinator, get_pp_group, get_tp_group, set_parallel_groups
from asyncstep.config import CacheConfig, ModelConfig
from asyncstep.errors import ConfigError, ModelLoadError
from asyncstep.models import memory
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import SHAPES
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.models.model_loader import load_model
from asyncstep.runner.kv_sizing import num_kv_blocks

REPO = Path(__file__).resolve().parents[2]
MAX_SECONDS = 5.0
MAX_PEAK_BYTES = 1 << 30

#: The tiny model every hostile file starts from.
BASE = ModelArchConfig(
    architecture="LlamaForCausalLM",
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)
HF_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
GGUF_META: dict[str, tuple[str, Any]] = {
    "llama.block_count": ("uint32", 2),
    "llama.context_length": ("uint32", 256),
    "llama.embedding_length": ("uint32", 32),
    "llama.feed_forward_length": ("uint32", 64),
    "llama.attention.head_count": ("uint32", 4),
    "llama.attention.head_count_kv": ("uint32", 2),
    "llama.rope.freq_base": ("float32", 10000.0),
    "llama.attention.layer_norm_rms_epsilon": ("float32", 1e-5),
    "llama.vocab_size": ("uint32", 32),
}
#: Where model.norm.weight lies in the base safetensors file (after the 32 x 32 embedding).
NORM = [4096, 4224]
GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

#: The subprocess: loads every case, prints one JSON line of results.
RUNNER = r"""
import json, sys, time
from asyncstep.config import ModelConfig
from asyncstep.errors import AsyncstepError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import SHAPES
from asyncstep.models.model_loader import load_model

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass

results = {}
for case in json.load(open(sys.argv[1])):
    if "shape" in case:
        SHAPES[case["model"]] = ModelArchConfig(**case["shape"])
    config = ModelConfig(model=case["model"], load_format=case["format"], device="cpu")
    reset_peak()
    start = time.perf_counter()
    try:
        load_model(config, with_tokenizer=False)
        error, message = None, ""
    except AsyncstepError as exc:
        error, message = type(exc).__name__, str(exc)
    except BaseException as exc:  # a raw error is a failure the test reports
        error, message = "raw " + type(exc).__name__, str(exc)[:300]
    results[case["name"]] = {
        "error": error, "message": message,
        "seconds": time.perf_counter() - start, "peak": peak(),
    }
print(json.dumps(results))
"""


# ---------------------------------------------------------------------------------------------
# writing files


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in GGUF_GLOBAL:
        return f"{GGUF_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{GGUF_BLOCK[rest]}.{kind}"


def base_tensors(arch: ModelArchConfig = BASE) -> dict[str, np.ndarray]:
    """HF-named float32 tensors of ``arch`` (what values they hold does not matter)."""
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in arch.weight_shapes().items()}


def write_gguf(
    path: Path,
    *,
    meta: dict[str, tuple[str, Any]] | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    tokens: int = 32,
) -> Path:
    """A tiny llama GGUF file: ``meta`` overrides (or, with a None value, drops)
    metadata; ``tensors`` are HF-named (default: the base model's)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in (GGUF_META | (meta or {})).items():
        if value is not None:
            getattr(writer, f"add_{kind}")(key, value)
    writer.add_token_list([f"t{i}" for i in range(tokens)])
    for name, array in (base_tensors() if tensors is None else tensors).items():
        writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tensor_info_position(path: Path, index: int, part: str) -> int:
    """Where tensor ``index``'s ``"type"`` or ``"offset"`` field lies in the file."""
    field = gguf.GGUFReader(path).tensors[index].field
    name_len, n_dims = int(field.parts[0][0]), int(field.parts[2][0])
    type_at = field.offset + 8 + name_len + 4 + 8 * n_dims
    return type_at if part == "type" else type_at + 4


def patched(src: Path, dst: Path, at: int, value: bytes) -> Path:
    data = bytearray(src.read_bytes())
    data[at : at + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


def write_safetensors(
    path: Path,
    tensors: dict[str, np.ndarray],
    *,
    entries: dict[str, dict[str, Any]] | None = None,
    header_len: int | None = None,
) -> Path:
    """A safetensors file of float32 ``tensors``; ``entries`` override header entries;
    ``header_len`` overrides the length prefix."""
    header: dict[str, Any] = {}
    offset, blobs = 0, []
    for name, array in tensors.items():
        blob = array.astype("<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    header |= entries or {}
    raw = json.dumps(header, separators=(",", ":")).encode()
    prefix = struct.pack("<Q", len(raw) if header_len is None else header_len)
    path.write_bytes(prefix + raw + b"".join(blobs))
    return path


def write_hf(
    directory: Path,
    config: Any = None,
    *,
    config_bytes: bytes | None = None,
    tensors: dict[str, np.ndarray] | None = None,
    **safetensors: Any,
) -> Path:
    directory.mkdir()
    text = json.dumps(HF_CONFIG if config is None else config).encode()
    (directory / "config.json").write_bytes(text if config_bytes is None else config_bytes)
    write_safetensors(
        directory / "model.safetensors",
        base_tensors() if tensors is None else tensors,
        **safetensors,
    )
    return directory


def norm_entry(dtype: str, shape: list[int], offsets: list[int]) -> dict[str, Any]:
    """A header entry for model.norm.weight."""
    return {"model.norm.weight": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}


def without(name: str) -> dict[str, np.ndarray]:
    tensors = base_tensors()
    del tensors[name]
    return tensors


def reshaped(name: str, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return base_tensors() | {name: np.zeros(shape, np.float32)}


# ---------------------------------------------------------------------------------------------
# the cases

#: name -> (writes the file into a directory and returns it and its load format,
#: the error expected (None: it loads), a regex its message matches).
Case = tuple[Callable[[Path], tuple[Path, str]], str | None, str]


def gguf_case(**kwargs: Any) -> Callable[[Path], tuple[Path, str]]:
    return lambda d: (write_gguf(d / "m.gguf", **kwargs), "auto")


def gguf_patch(index: int, part: str, value: bytes) -> Callable[[Path], tuple[Path, str]]:
    def make(d: Path) -> tuple[Path, str]:
        base = write_gguf(d / "base.gguf")
        return patched(base, d / "m.gguf", tensor_info_position(base, index, part), value), "auto"

    return make


def gguf_offset_past_eof(d: Path) -> tuple[Path, str]:
    base = write_gguf(d / "base.gguf")
    offset = (base.stat().st_size + 31) // 32 * 32
    at = tensor_info_position(base, 0, "offset")
    return patched(base, d / "m.gguf", at, struct.pack("<Q", offset)), "auto"


def gguf_overlap(d: Path) -> tuple[Path, str]:
    base = write_gguf(d / "base.gguf")
    # tensor 1 (model.norm, 32 floats) moved onto tensor 0's (the embedding's) bytes
    at = tensor_info_position(base, 1, "offset")
    return patched(base, d / "m.gguf", at, struct.pack("<Q", 0)), "auto"


def gguf_truncated(d: Path) -> tuple[Path, str]:
    base = write_gguf(d / "base.gguf")
    data = base.read_bytes()
    (d / "m.gguf").write_bytes(data[: len(data) * 2 // 3])
    return d / "m.gguf", "auto"


def gguf_header_patch(at_field: str, value: bytes) -> Callable[[Path], tuple[Path, str]]:
    """Patch the header's key count (``"kv_count"``) or a metadata array's length."""

    def make(d: Path) -> tuple[Path, str]:
        base = write_gguf(d / "base.gguf")
        if at_field == "kv_count":
            at = 16
        else:
            field = gguf.GGUFReader(base).fields[at_field]
            at = field.offset + 8 + int(field.parts[0][0]) + 4 + 4
        return patched(base, d / "m.gguf", at, value), "auto"

    return make


def gguf_string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def gguf_many_strings(d: Path) -> tuple[Path, str]:
    """A hand-made GGUF file whose token list holds 2**21 - 1 empty strings (16 MiB):
    the stock reader makes two numpy views of each (~2.6 GB, minutes)."""
    count = 2**21 - 1
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    arch = gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("llama")
    tokens = gguf_string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, count)
    path = d / "m.gguf"
    path.write_bytes(header + arch + tokens + bytes(8 * count))
    return path, "auto"


def hf_case(config: Any = None, **kwargs: Any) -> Callable[[Path], tuple[Path, str]]:
    return lambda d: (write_hf(d / "hf", config, **kwargs), "auto")


def hf_index_escape(d: Path) -> tuple[Path, str]:
    directory = write_hf(d / "hf")
    index = {"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory, "auto"


def hf_generation_eos(d: Path) -> tuple[Path, str]:
    directory = write_hf(d / "hf")
    generation = {"eos_token_id": list(range(10**6))}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory, "auto"


def hf_dummy(config: dict[str, Any]) -> Callable[[Path], tuple[Path, str]]:
    return lambda d: (write_hf(d / "hf", config), "dummy")


def hf_with(**changes: Any) -> dict[str, Any]:
    return HF_CONFIG | changes


CASES: dict[str, Case] = {
    # controls: the files every hostile case breaks load
    "gguf control": (gguf_case(), None, ""),
    "hf control": (hf_case(), None, ""),
    # GGUF metadata
    "gguf huge hidden": (
        gguf_case(meta={"llama.embedding_length": ("uint32", 10**9)}),
        "ModelLoadError",
        r"hidden_size must be in \[1, 65536\], got 1000000000",
    ),
    "gguf huge context": (
        gguf_case(meta={"llama.context_length": ("uint32", 2**26)}),
        "ModelLoadError",
        "max_position_embeddings must be in",
    ),
    "gguf huge block_count": (
        gguf_case(meta={"llama.block_count": ("uint32", 10**7)}),
        "ModelLoadError",
        "num_hidden_layers must be in",
    ),
    "gguf vocab 2**40": (
        gguf_case(meta={"llama.vocab_size": ("uint64", 2**40)}),
        "ModelLoadError",
        "vocab_size must be in",
    ),
    "gguf negative size": (
        gguf_case(meta={"llama.block_count": ("int32", -1)}),
        "ModelLoadError",
        r"num_hidden_layers must be in \[1, 1024\], got -1",
    ),
    "gguf bool as size": (
        gguf_case(meta={"llama.embedding_length": ("bool", True)}),
        "ModelLoadError",
        "embedding_length must be an integer, got True",
    ),
    "gguf nan eps": (
        gguf_case(meta={"llama.attention.layer_norm_rms_epsilon": ("float32", float("nan"))}),
        "ModelLoadError",
        "rms_norm_eps must be a finite number",
    ),
    "gguf missing size": (
        gguf_case(meta={"llama.embedding_length": ("uint32", None)}),
        "ModelLoadError",
        "lacks llama.embedding_length",
    ),
    "gguf huge key count": (
        gguf_header_patch("kv_count", struct.pack("<Q", 2**62)),
        "ModelLoadError",
        "metadata keys",
    ),
    "gguf huge array": (
        gguf_header_patch("tokenizer.ggml.tokens", struct.pack("<Q", 2**40)),
        "ModelLoadError",
        "a metadata array of 1,099,511,627,776 elements",
    ),
    "gguf more tokens than vocabulary": (
        gguf_case(tokens=33),
        "ModelLoadError",
        "tokenizer.ggml.tokens has 33 entries, more than a vocabulary of 32 can use",
    ),
    "gguf two million strings": (
        gguf_many_strings,
        "ModelLoadError",
        "lacks llama.embedding_length",
    ),
    # GGUF tensors
    "gguf offset 2**64-1": (
        gguf_patch(0, "offset", struct.pack("<Q", 2**64 - 1)),
        "ModelLoadError",
        "not aligned",
    ),
    "gguf offset wraps aligned": (
        gguf_patch(0, "offset", struct.pack("<Q", 2**64 - 32)),
        "ModelLoadError",
        "truncated or corrupt GGUF file: tensor 'token_embd.weight' needs bytes",
    ),
    "gguf offset past eof": (gguf_offset_past_eof, "ModelLoadError", "needs bytes up to"),
    "gguf overlapping tensors": (gguf_overlap, "ModelLoadError", "overlap"),
    "gguf unknown dtype": (gguf_patch(0, "type", struct.pack("<I", 99)), "ModelLoadError", "99"),
    "gguf truncated": (gguf_truncated, "ModelLoadError", "truncated"),
    "gguf shape mismatch": (
        gguf_case(tensors=reshaped("model.layers.1.self_attn.q_proj.weight", (16, 32))),
        "ModelLoadError",
        r"'blk\.1\.attn_q\.weight' has shape \(16, 32\), but the metadata implies \(32, 32\)",
    ),
    "gguf missing tensor": (
        gguf_case(tensors=without("model.layers.1.mlp.down_proj.weight")),
        "ModelLoadError",
        r"lacks 1 of the tensors .* model\.layers\.1\.mlp\.down_proj\.weight",
    ),
    "gguf tensor of a layer it lacks": (
        gguf_case(
            tensors=base_tensors()
            | {"model.layers.2.input_layernorm.weight": np.ones(32, np.float32)}
        ),
        "ModelLoadError",
        r"'blk\.2\.attn_norm\.weight' has no place",
    ),
    # HF config.json
    "hf garbage config": (
        hf_case(config_bytes=bytes(range(256)) * 4),
        "ModelLoadError",
        "invalid JSON",
    ),
    "hf non-object config": (hf_case([1, 2, 3]), "ModelLoadError", "expected a JSON object"),
    "hf deeply nested config": (
        hf_case(config_bytes=b"[" * 200_000),
        "ModelLoadError",
        "invalid JSON",
    ),
    "hf 5000-digit size": (
        hf_case(config_bytes=b'{"hidden_size": 1' + b"0" * 5000 + b"}"),
        "ModelLoadError",
        "invalid JSON",
    ),
    "hf hidden_size 1e300": (
        hf_case(hf_with(hidden_size=1e300)),
        "ModelLoadError",
        "hidden_size must be an integer, got 1e",
    ),
    "hf huge hidden": (hf_case(hf_with(hidden_size=10**9)), "ModelLoadError", "hidden_size"),
    "hf vocab 2**40": (hf_case(hf_with(vocab_size=2**40)), "ModelLoadError", "vocab_size"),
    "hf huge context": (
        hf_case(hf_with(max_position_embeddings=2**26)),
        "ModelLoadError",
        "max_position_embeddings",
    ),
    "hf negative size": (
        hf_case(hf_with(num_hidden_layers=-1)),
        "ModelLoadError",
        r"num_hidden_layers must be in \[1, 1024\], got -1",
    ),
    "hf bool as size": (
        hf_case(hf_with(hidden_size=True)),
        "ModelLoadError",
        "hidden_size must be an integer, got True",
    ),
    "hf string flag": (
        hf_case(hf_with(tie_word_embeddings="false")),
        "ModelLoadError",
        "tie_word_embeddings must be true or false",
    ),
    "hf a million eos ids": (
        hf_case(hf_with(eos_token_id=list(range(10**6)))),
        "ModelLoadError",
        "eos_token_ids must be a tuple of at most 256 token ids",
    ),
    "hf a million generation eos ids": (
        hf_generation_eos,
        "ModelLoadError",
        "generation_config.json: eos_token_id lists 1,000,000 token ids",
    ),
    "hf rope factor x": (
        hf_case(hf_with(rope_scaling={"factor": "x"})),
        "ModelLoadError",
        "rope_scaling.factor must be a finite number, got 'x'",
    ),
    "hf rope not an object": (
        hf_case(hf_with(rope_scaling="linear")),
        "ModelLoadError",
        "rope_scaling must be an object",
    ),
    "hf rope of an unknown type": (
        hf_case(hf_with(rope_scaling={"rope_type": "longrope", "factor": 4.0})),
        "UnsupportedModelError",
        "unsupported rope scaling 'longrope'",
    ),
    "hf llama3 rope without its fields": (
        hf_case(hf_with(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
        "ModelLoadError",
        "lacks low_freq_factor",
    ),
    # safetensors
    "safetensors shape mismatch": (
        hf_case(tensors=reshaped("model.layers.0.mlp.up_proj.weight", (64, 31))),
        "ModelLoadError",
        r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(64, 31\), but the config",
    ),
    "safetensors missing tensor": (
        hf_case(tensors=without("lm_head.weight")),
        "ModelLoadError",
        r"lacks 1 of the tensors its config implies, e\.g\. lm_head\.weight",
    ),
    "safetensors unexpected tensor": (
        hf_case(tensors=base_tensors() | {"model.extra.weight": np.ones(2, np.float32)}),
        "ModelLoadError",
        "'model.extra.weight' has no place",
    ),
    "safetensors unknown dtype": (
        hf_case(entries=norm_entry("X9", [32], NORM)),
        "ModelLoadError",
        "unknown dtype 'X9'",
    ),
    "safetensors integer weights": (
        hf_case(entries=norm_entry("I32", [32], NORM)),
        "UnsupportedModelError",
        "is I32; weights must be",
    ),
    "safetensors header length 2**63": (
        hf_case(header_len=2**63),
        "ModelLoadError",
        "header length",
    ),
    "safetensors offsets past eof": (
        hf_case(
            entries={
                "model.norm.weight": {
                    "dtype": "F32",
                    "shape": [32],
                    "data_offsets": [2**40, 2**40 + 128],
                }
            }
        ),
        "ModelLoadError",
        "truncated safetensors file",
    ),
    "safetensors huge shape": (
        hf_case(entries=norm_entry("F32", [2**40, 2**40], [0, 8])),
        "ModelLoadError",
        "bad offsets for 'model.norm.weight'",
    ),
    "safetensors overlapping tensors": (
        hf_case(
            entries={"model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]}}
        ),
        "ModelLoadError",
        "overlaps",
    ),
    "safetensors header of many entries": (
        hf_case(
            entries={
                f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
                for i in range(200_000)
            }
        ),
        "ModelLoadError",
        r"200,\d+ tensors, more than the config's model has",
    ),
    "index naming a file outside": (hf_index_escape, "ModelLoadError", "not a file of"),
    # dummy weights
    "dummy huge hidden": (
        hf_dummy(hf_with(hidden_size=10**9)),
        "ModelLoadError",
        "hidden_size must be in",
    ),
}

#: Dummy shapes within the bounds but far past any machine's memory.
SHAPE_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "dummy shape past the memory": (
        {
            "architecture": "LlamaForCausalLM",
            "vocab_size": 2**20,
            "hidden_size": 2**16,
            "intermediate_size": 2**18,
            "num_hidden_layers": 2**10,
            "num_attention_heads": 2**9,
            "num_key_value_heads": 2**9,
            "head_dim": 128,
            "max_position_embeddings": 2**24,
        },
        "ModelLoadError",
        r"the model \(.* GiB of float32 weights.*\) needs .* on cpu but only .* is available",
    ),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every case loaded in one subprocess: {name: error, message, seconds, peak}."""
    root = tmp_path_factory.mktemp("hostile")
    cases: list[dict[str, Any]] = []
    for i, (name, (make, _, _)) in enumerate(CASES.items()):
        directory = root / f"case{i}"
        directory.mkdir()
        path, load_format = make(directory)
        cases.append({"name": name, "model": str(path), "format": load_format})
    for name, (shape, _, _) in SHAPE_CASES.items():
        cases.append({"name": name, "model": name, "format": "dummy", "shape": shape})
    (root / "cases.json").write_text(json.dumps(cases))
    env = {"PYTHONPATH": str(REPO), "ASYNCSTEP_CACHE_DIR": str(root / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(root / "cases.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: dict[str, dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    for name, got in loaded.items():
        print(f"{name:40} {got['seconds']:6.3f} s {got['peak'] / 2**20:6.0f} MiB  {got['message']}")
    return loaded


EXPECTED = {name: (error, match) for name, (_, error, match) in CASES.items()} | {
    name: (error, match) for name, (_, error, match) in SHAPE_CASES.items()
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_hostile_file_is_refused_fast_and_small(
    results: dict[str, dict[str, Any]], name: str
) -> None:
    got = results[name]
    error, match = EXPECTED[name]
    assert got["error"] == error, f"{name}: {got['error']}: {got['message']}"
    assert re.search(match, got["message"]), got["message"]
    assert "\n" not in got["message"]
    assert got["seconds"] < MAX_SECONDS, f"{name}: {got['seconds']:.2f} s"
    assert got["peak"] < MAX_PEAK_BYTES, f"{name}: peak RSS {got['peak'] / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------
# the memory estimate, in process


@contextmanager
def as_rank(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> Iterator[None]:
    """Build models as one TP x PP rank (the layers read the groups when built)."""
    old_tp, old_pp = get_tp_group(), get_pp_group()
    set_parallel_groups(
        GroupCoordinator(ranks=tuple(range(tp_size)), rank_in_group=tp_rank),
        GroupCoordinator(ranks=tuple(range(pp_size)), rank_in_group=pp_rank),
    )
    try:
        yield
    finally:
        set_parallel_groups(old_tp, old_pp)


def assert_each_rank_builds_the_estimate(arch: ModelArchConfig, tp: int, pp: int) -> None:
    """Each PP rank (of TP rank 0 of ``tp``) builds, on the meta device, the
    parameters the memory estimate counts, each of a checkpoint name the
    config expects."""
    from asyncstep.models.registry import model_class

    for pp_rank in range(pp):
        with as_rank(0, tp, pp_rank, pp), torch.device("meta"):
            model = model_class(arch)(arch, torch.float32)
        built = sum(p.numel() for p in model.parameters())
        assert memory.rank_param_count(arch, tp_size=tp, pp_rank=pp_rank, pp_size=pp) == built
        assert model.expected_weight_names() <= set(arch.weight_shapes())


QWEN2 = BASE.replace(architecture="Qwen2ForCausalLM", attention_bias=True)


@pytest.mark.parametrize(
    ("shape", "tp", "pp"),
    [
        ("tiny-llama", 1, 1),
        ("smollm2-135m", 3, 1),
        ("smollm2-135m", 1, 4),
        ("llama-1b", 2, 2),
        ("llama-8b", 8, 1),
        ("qwen3-0.6b", 2, 3),
        ("qwen2-bias", 2, 2),
    ],
)
def test_estimate_is_the_parameters_each_rank_builds(shape: str, tp: int, pp: int) -> None:
    arch = QWEN2 if shape == "qwen2-bias" else SHAPES[shape]
    for pp_rank in range(pp):
        with as_rank(0, tp, pp_rank, pp), torch.device("meta"):
            model = LlamaForCausalLM(arch, torch.bfloat16)
        built = sum(p.numel() for p in model.parameters())
        assert memory.rank_param_count(arch, tp_size=tp, pp_rank=pp_rank, pp_size=pp) == built
        need = memory.model_memory(arch, torch.bfloat16, tp_size=tp, pp_rank=pp_rank, pp_size=pp)
        assert need.weights == 2 * built


def test_model_refused_before_it_is_built_when_memory_is_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "available_host_memory", lambda: 1 << 20)
    monkeypatch.setattr(
        LlamaForCausalLM, "__init__", lambda *a, **k: pytest.fail("built before the check")
    )
    refusal = (
        r"tiny-llama: the model \(.* MiB of float32 weights, .*\) needs 1\.\d MiB on cpu "
        r"but only 1\.0 MiB is available"
    )
    with pytest.raises(ModelLoadError, match=refusal):
        load_model(ModelConfig(model="tiny-llama", load_format="dummy", device="cpu"))


def test_model_that_fits_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    need = memory.model_memory(SHAPES["tiny-llama"], torch.float32, random_weights=True)
    total = need.weights + need.rotary + need.loading
    monkeypatch.setattr(memory, "available_host_memory", lambda: total)
    loaded = load_model(ModelConfig(model="tiny-llama", load_format="dummy", device="cpu"))
    assert sum(p.numel() * 4 for p in loaded.model.parameters()) == need.weights


def test_kv_cache_refused_when_memory_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    sizing: dict[str, Any] = {
        "block_bytes": 1 << 20,
        "max_model_len": 1024,
        "max_num_running_reqs": 4,
        "max_num_batched_tokens": 256,
        "arch": SHAPES["tiny-llama"],
        "device": torch.device("cpu"),
        "dtype": torch.float32,
    }
    monkeypatch.setattr(memory, "available_host_memory", lambda: 100 << 20)
    assert num_kv_blocks(CacheConfig(num_blocks=100), **sizing) == 100
    refusal = r"KV cache \(101 blocks\) needs 101\.0 MiB on cpu but only 100\.0 MiB"
    with pytest.raises(ConfigError, match=refusal):
        num_kv_blocks(CacheConfig(num_blocks=101), **sizing)
    with pytest.raises(ConfigError, match=r"KV cache \(256 blocks\)"):
        num_kv_blocks(CacheConfig(kv_cache_memory_gib=1.0), **sizing)


def test_tokenizer_conversion_refused_when_memory_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncstep.models.loader import GGUFCheckpoint
    from asyncstep.models.loader import tokenizer as tokenizer_mod

    monkeypatch.setenv("ASYNCSTEP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(memory, "available_host_memory", lambda: 10 << 10)
    monkeypatch.setattr(tokenizer_mod, "_convert", lambda *a: pytest.fail("converted"))
    checkpoint = GGUFCheckpoint(write_gguf(tmp_path / "m.gguf"))
    with pytest.raises(ModelLoadError, match=r"converting its tokenizer \(32 entries\) needs"):
        checkpoint.load_tokenizer()


def test_huge_tokenizer_file_refused(tmp_path: Path) -> None:
    from asyncstep.models.loader import HFCheckpoint

    directory = write_hf(tmp_path / "hf")
    with (directory / "tokenizer.json").open("wb") as f:
        f.truncate((128 << 20) + 1)  # sparse: no disk, no memory
    with pytest.raises(ModelLoadError, match="more than a tokenizer file may hold"):
        HFCheckpoint(directory).load_tokenizer()


def test_checked_reader_agrees_with_the_stock_reader(tmp_path: Path) -> None:
    """Arrays are kept whole, not element by element; everything else is the stock
    reader's: the same keys, scalar values, array lengths and tensors."""
    from asyncstep.models.loader.gguf import GGUFCheckpoint

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (kind, value) in GGUF_META.items():
        getattr(writer, f"add_{kind}")(key, value)
    writer.add_token_list([f"t{i}" for i in range(32)])
    writer.add_token_types([1] * 32)
    writer.add_token_scores([float(-i) for i in range(32)])
    writer.add_token_merges(["t 1", "t1 0", "é ü"])
    writer.add_chat_template("{{ messages }}")
    for name, array in base_tensors().items():
        writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    stock, checkpoint = gguf.GGUFReader(path), GGUFCheckpoint(path)
    ours = checkpoint._reader
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].types == field.types, key
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert checkpoint._metadata.array_length(key) == len(field.data), key
            items = ours.fields[key].parts[-1]
            assert items.nbytes == sum(field.parts[i].nbytes for i in range(5, len(field.parts)))
        elif not key.startswith("GGUF."):
            assert checkpoint.metadata(key) == field.contents(), key
    assert ours.data_offset == stock.data_offset
    for mine, theirs in zip(ours.tensors, stock.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes) == (
            theirs.name,
            theirs.tensor_type,
            theirs.n_bytes,
        )
        assert mine.data_offset == theirs.data_offset
        assert np.array_equal(mine.data, theirs.data)


def test_available_memory_is_read() -> None:
    free = memory.available_host_memory()
    assert free is not None and free > 0
    assert memory.available_memory(torch.device("meta")) is None


def test_the_kv_cache_counts_the_memory_torch_holds_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the sizing gives back torch's cached, freed blocks (the load's
    temporaries) before it reads the device's free memory: they are the KV
    cache's. A device faked: 40 GiB free, 14 GiB more cached by torch."""
    device = {"free": 40 << 30, "cached": 14 << 30, "total": 80 << 30}

    def empty_cache() -> None:
        device["free"], device["cached"] = device["free"] + device["cached"], 0

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda _: (device["free"], device["total"]))
    sizing: dict[str, Any] = {
        "block_bytes": 1 << 20,
        "max_model_len": 1 << 20,
        "max_num_running_reqs": 1,
        "max_num_batched_tokens": 256,
        "arch": SHAPES["tiny-llama"],
        "device": torch.device("cuda"),
        "dtype": torch.float32,
    }
    blocks = num_kv_blocks(CacheConfig(gpu_memory_utilization=0.9), **sizing)
    arch = SHAPES["tiny-llama"]
    width = 4 * arch.hidden_size + 2 * arch.intermediate_size
    activations = 256 * width * 4 + arch.vocab_size * 4 * 3 + (1 << 30)
    expected = ((40 + 14) * 2**30 - 0.1 * (80 << 30) - activations) // (1 << 20)
    assert device["cached"] == 0 and blocks == int(expected)
