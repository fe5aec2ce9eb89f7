"""The packed CPU model cached on disk (:mod:`asyncstep.models.weight_cache`):
a second load maps what the first one packed, the same model to the bit; an
entry that does not fit is ignored and written again; the key follows the
checkpoint and the options."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, load_model, packs_cpu_dtype, resolve_dtype
from asyncstep.models.weight_cache import PackedCache
from asyncstep.ops.packed import PackedWeight

pytestmark = pytest.mark.skipif(
    not packs_cpu_dtype(resolve_dtype("auto", torch.device("cpu")), explicit=False),
    reason="this CPU packs (and caches) no model of its default dtype: float32 without "
    "the library's vector build",
)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ASYNCSTEP_CACHE_DIR", str(tmp_path))
    return tmp_path / "weights"


def entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.safetensors"))


def packed_of(loaded: LoadedModel) -> dict[str, PackedWeight]:
    return {
        name: module.packed
        for name, module in loaded.model.named_modules()
        if isinstance(getattr(module, "packed", None), PackedWeight)
    }


def assert_same_model(cached: LoadedModel, built: LoadedModel) -> None:
    got, want = cached.model.state_dict(), built.model.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    got_packed, want_packed = packed_of(cached), packed_of(built)
    assert got_packed.keys() == want_packed.keys() and want_packed
    for name, weight in want_packed.items():
        other = got_packed[name]
        assert type(other) is type(weight) and other.kind == weight.kind, name
        assert torch.equal(other.data, weight.data) and torch.equal(other.scales, weight.scales)
        assert (other.out_features, other.in_features) == (weight.out_features, weight.in_features)
        assert other.max_tokens == weight.max_tokens
    head, embed = cached.model.lm_head, cached.model.model.embed_tokens
    assert head is not None and embed is not None and head.weight is embed.weight


def test_a_second_load_maps_the_first_ones_packed_model(cache_dir: Path) -> None:
    config = ModelConfig(device="cpu")
    built = load_model(config, with_tokenizer=False)
    [entry] = entries(cache_dir)
    cached = load_model(config, with_tokenizer=False)
    assert_same_model(cached, built)
    assert entries(cache_dir) == [entry]
    uncached = load_model(
        ModelConfig(device="cpu", packed_weight_cache=False), with_tokenizer=False
    )
    assert_same_model(uncached, built)


def test_an_entry_that_does_not_fit_is_ignored_and_written_again(cache_dir: Path) -> None:
    config = ModelConfig(device="cpu")
    built = load_model(config, with_tokenizer=False)
    [entry] = entries(cache_dir)
    size = entry.stat().st_size
    for damage in (b"not a safetensors file", entry.read_bytes()[: size // 2]):
        entry.write_bytes(damage)
        again = load_model(config, with_tokenizer=False)
        assert_same_model(again, built)
        assert entries(cache_dir) == [entry] and entry.stat().st_size == size


def test_the_key_follows_the_checkpoint_and_the_options(tmp_path: Path, cache_dir: Path) -> None:
    checkpoint = tmp_path / "model.gguf"
    checkpoint.write_bytes(b"weights")
    first = PackedCache.for_checkpoint(checkpoint, {"packed_max_tokens": 16})
    assert first is not None
    assert PackedCache.for_checkpoint(checkpoint, {"packed_max_tokens": 16}) == first
    other = PackedCache.for_checkpoint(checkpoint, {"packed_max_tokens": 8})
    assert other is not None and other.path.parent == first.path.parent
    assert other.path.name.partition("-")[0] != first.path.name.partition("-")[0]
    stat = checkpoint.stat()
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = PackedCache.for_checkpoint(checkpoint, {"packed_max_tokens": 16})
    assert touched is not None and touched != first
    # the same checkpoint and options: a new entry replaces the one it outdates
    assert touched.path.name.partition("-")[0] == first.path.name.partition("-")[0]
    assert PackedCache.for_checkpoint(tmp_path / "missing.gguf", {}) is None
