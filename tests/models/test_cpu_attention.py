"""The CPU attention kernel against dense causal attention in float64 and
against the torch reference: random paged layouts, ragged lengths, GQA,
decodes mixed with prompt chunks, padding rows, fp32 and bf16."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncstep.errors import ConfigError
from asyncstep.models.layers.attention import (
    Attention,
    AttentionMetadata,
    kv_cache_shape,
    plan_decode_buckets,
    reference_attention,
)
from asyncstep.models.layers.rotary import RotaryEmbedding
from asyncstep.models.model_loader import LoadedModel
from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.attention import CpuPagedAttention
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.paged_attention import CpuAttention, cpu_step_args
from asyncstep.ops.select import resolve_attention_backend
from asyncstep.ops.slot import OpSetSlot
from asyncstep.ops.torch_attention import TORCH_ATTENTION
from asyncstep.ops.torch_ref import TorchOps
from asyncstep.runner.model_runner import ModelRunner

#: bf16 outputs are rounded to bf16 (a relative step of 2**-8): torch's bf16 tolerance.
BF16_TOL = {"atol": 1e-2, "rtol": 1.6e-2}
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def kernel() -> CpuPagedAttention:
    loaded = load_cpu_kernels()
    if loaded is None:
        pytest.skip("the CPU kernels do not build here (no C compiler)")
    return loaded.attention


@dataclass
class PagedStep:
    """One step over a random paged cache: each request's prefix already
    stored, its new keys/values in ``k``/``v`` (not stored yet)."""

    q: torch.Tensor  # [tokens, heads * dim]
    k: torch.Tensor  # [tokens, kv_heads * dim]
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    full_k: list[torch.Tensor]  # per request [seq_len, kv_heads, dim]
    full_v: list[torch.Tensor]
    heads: int
    dim: int

    @property
    def scale(self) -> float:
        return float(self.dim**-0.5)


def make_step(
    query_lens: list[int],
    computed: list[int],
    *,
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    seed: int,
) -> PagedStep:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(computed, query_lens, strict=True)]
    per_req = [-(-s // block) for s in seq_lens]
    num_blocks = sum(per_req) + 3  # spare blocks: never read
    kv_cache = torch.randn(kv_cache_shape(num_blocks, block, kv_heads, dim), generator=gen)
    kv_cache = kv_cache.to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    # Wider than needed, padded with a spare block of random keys: reading
    # past a request's own blocks would show in its output.
    spare = free.pop()
    block_table = torch.full((len(seq_lens), max(per_req) + 2), spare, dtype=torch.int32)
    by_slot = kv_cache.view(2, kv_heads, -1, dim)
    full_k, full_v, slots = [], [], []
    for r, s in enumerate(seq_lens):
        block_table[r, : per_req[r]] = torch.tensor([free.pop() for _ in range(per_req[r])])
        full_k.append(torch.randn(s, kv_heads, dim, generator=gen).to(dtype))
        full_v.append(torch.randn(s, kv_heads, dim, generator=gen).to(dtype))
        pos = torch.arange(s)
        req_slots = block_table[r, pos // block].long() * block + pos % block
        prefix = req_slots[: computed[r]]  # already in the cache
        by_slot[0][:, prefix] = full_k[r][: computed[r]].transpose(0, 1)
        by_slot[1][:, prefix] = full_v[r][: computed[r]].transpose(0, 1)
        slots += req_slots[computed[r] :].tolist()
    q = torch.randn(sum(query_lens), heads * dim, generator=gen).to(dtype)
    k = torch.cat([full_k[r][computed[r] :] for r in range(len(seq_lens))]).flatten(1)
    v = torch.cat([full_v[r][computed[r] :] for r in range(len(seq_lens))]).flatten(1)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    meta = AttentionMetadata(
        num_actual_tokens=len(slots),
        num_decodes=num_decodes,
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array(seq_lens, dtype=np.int32),
        positions=torch.cat([torch.arange(c, s) for c, s in zip(computed, seq_lens, strict=True)]),
    )
    return PagedStep(q, k, v, kv_cache, meta, full_k, full_v, heads, dim)


def dense_attention(step: PagedStep) -> torch.Tensor:
    """Each request's queries over its whole sequence, causal, in float64."""
    qsl, outs = step.meta.query_start_loc_cpu, []
    for r, (k, v) in enumerate(zip(step.full_k, step.full_v, strict=True)):
        q = step.q[qsl[r] : qsl[r + 1]].double().view(-1, step.heads, step.dim)
        group = step.heads // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * step.scale
        q_len, seq = q.shape[0], k.shape[0]
        mask = torch.ones(q_len, seq, dtype=torch.bool).tril(seq - q_len)
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1))
    return torch.cat(outs)


def run_kernel(kernel: CpuPagedAttention, step: PagedStep, threads: int = 1) -> torch.Tensor:
    out = torch.empty_like(step.q)
    args = cpu_step_args(step.meta)
    kernel(out, step.q, step.k, step.v, step.kv_cache, args, step.scale, num_threads=threads)
    return out


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return BF16_TOL if dtype == torch.bfloat16 else FP32_TOL


@st.composite
def paged_layouts(draw: st.DrawFn) -> dict[str, object]:
    """Decodes first (ragged lengths), then prompt chunks with or without a
    cached prefix; GQA groups 1..4, head sizes with and without a
    specialised path, block sizes 1..16."""
    num_decodes = draw(st.integers(0, 5))
    num_chunks = draw(st.integers(0 if num_decodes else 1, 3))
    query_lens = [1] * num_decodes + draw(
        st.lists(st.integers(2, 40), min_size=num_chunks, max_size=num_chunks)
    )
    computed = draw(
        st.lists(st.integers(0, 150), min_size=len(query_lens), max_size=len(query_lens))
    )
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    return {
        "query_lens": query_lens,
        "computed": computed,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 3, 4])),
        "kv_heads": kv_heads,
        "dim": draw(st.sampled_from([8, 16, 32, 64, 128])),
        "block": draw(st.sampled_from([1, 4, 16])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=60, deadline=None)
@given(layout=paged_layouts(), bf16=st.booleans())
def test_kernel_matches_dense_attention(
    kernel: CpuPagedAttention, layout: dict[str, object], bf16: bool
) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    step = make_step(dtype=dtype, **layout)  # type: ignore[arg-type]
    out = run_kernel(kernel, step)
    torch.testing.assert_close(out.double(), dense_attention(step), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_torch_reference(kernel: CpuPagedAttention, dtype: torch.dtype) -> None:
    """SmolLM2's heads (9 query / 3 KV, dim 64): decodes of ragged lengths,
    then a prompt with no prefix and a chunk after a cached prefix."""
    step = make_step(
        [1] * 6 + [17, 9],
        [40, 3, 77, 16, 0, 120, 0, 50],
        heads=9,
        kv_heads=3,
        dim=64,
        block=16,
        dtype=dtype,
        seed=1,
    )
    meta = step.meta
    meta.decode_buckets = plan_decode_buckets(
        meta.seq_lens_cpu[: meta.num_decodes], meta.block_table[: meta.num_decodes], 16
    )
    n = meta.num_actual_tokens
    out = run_kernel(kernel, step)  # stores the new keys, which the reference reads
    expected = reference_attention(
        step.q.view(n, 9, 64),
        step.k.view(n, 3, 64),
        step.v.view(n, 3, 64),
        step.kv_cache,
        meta,
        step.scale,
    ).flatten(1)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


def test_kernel_stores_new_keys_at_their_slots_only(kernel: CpuPagedAttention) -> None:
    """Slot -1 stores nothing (here the first decode's token)."""
    step = make_step(
        [1, 1, 5], [6, 0, 9], heads=4, kv_heads=2, dim=8, block=4, dtype=torch.float32, seed=2
    )
    step.meta.slot_mapping[0] = -1
    before = step.kv_cache.clone()
    run_kernel(kernel, step)
    slots = step.meta.slot_mapping[1:]
    by_slot = step.kv_cache.view(2, 2, -1, 8)  # [k/v, kv_heads, slot, dim]
    new = torch.stack([step.k.view(-1, 2, 8), step.v.view(-1, 2, 8)]).transpose(1, 2)
    torch.testing.assert_close(by_slot[:, :, slots], new[:, :, 1:], rtol=0, atol=0)
    untouched = torch.ones(by_slot.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(by_slot[:, :, untouched], before.view(2, 2, -1, 8)[:, :, untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_equals_rotating_first(kernel: CpuPagedAttention, dtype: torch.dtype) -> None:
    """With the rotary's cache the kernel rotates q (as it reads it) and k
    (as it stores it), leaving its inputs as they were."""
    layout = {"query_lens": [1, 1, 6], "computed": [40, 7, 12]}
    shape = {"heads": 6, "kv_heads": 2, "dim": 16, "block": 4, "dtype": dtype, "seed": 5}
    fused, first = make_step(**layout, **shape), make_step(**layout, **shape)
    rotary = RotaryEmbedding(16, 64, 10000.0)
    positions = fused.meta.positions
    assert positions is not None
    first.q, first.k = rotary(rotary.cos_sin(positions, dtype), first.q, first.k)
    q_before, k_before = fused.q.clone(), fused.k.clone()
    out = torch.empty_like(fused.q)
    args = cpu_step_args(fused.meta)
    kernel(out, fused.q, fused.k, fused.v, fused.kv_cache, args, fused.scale, rotary.cos_sin_cache)
    assert torch.equal(fused.q, q_before) and torch.equal(fused.k, k_before)
    expected = run_kernel(kernel, first)
    torch.testing.assert_close(fused.kv_cache, first.kv_cache, **tolerance(dtype))
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_does_not_change_the_output(
    kernel: CpuPagedAttention, dtype: torch.dtype
) -> None:
    # Enough work for two threads (small calls run on one).
    layout = {"query_lens": [1, 1, 1, 30], "computed": [300, 640, 50, 200]}
    one = make_step(**layout, heads=6, kv_heads=2, dim=64, block=16, dtype=dtype, seed=3)
    two = make_step(**layout, heads=6, kv_heads=2, dim=64, block=16, dtype=dtype, seed=3)
    assert torch.equal(run_kernel(kernel, one, threads=1), run_kernel(kernel, two, threads=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_layer_pads_and_matches_the_reference_backend(
    kernel: CpuPagedAttention, dtype: torch.dtype
) -> None:
    """Through :class:`Attention`: q/k/v as the fused QKV projection gives
    them (column slices of one matrix), two padding rows (sequence
    parallelism) that store nothing and come out as zeros."""
    heads, kv_heads, dim, block = 6, 2, 16, 4
    layout = {"query_lens": [1, 1, 7], "computed": [9, 2, 4]}
    steps = [
        make_step(
            **layout, heads=heads, kv_heads=kv_heads, dim=dim, block=block, dtype=dtype, seed=4
        )
        for _ in range(2)
    ]
    outs = []
    for attention, step in zip((CpuAttention(kernel), TORCH_ATTENTION), steps, strict=True):
        layer = Attention(
            heads, dim, kv_heads, scale=step.scale, ops=OpSetSlot(TorchOps(attention))
        )
        layer.kv_cache = step.kv_cache
        meta = step.meta
        meta.decode_buckets = plan_decode_buckets(
            meta.seq_lens_cpu[:2], meta.block_table[:2], block, min_bucket=1
        )
        meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([-1, -1])])
        qkv = torch.cat([step.q, step.k, step.v], 1)
        qkv = torch.cat([qkv, torch.full((2, qkv.shape[1]), 9.0, dtype=dtype)])
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
        outs.append(layer(q, k, v, meta))
    assert torch.equal(steps[0].kv_cache, steps[1].kv_cache)
    assert bool((outs[0][-2:] == 0).all())
    torch.testing.assert_close(outs[0], outs[1], **tolerance(dtype))


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[None]:
    """``load_cpu_kernels`` forgets its cached answer, and builds into a
    temporary cache, before and after the test."""
    monkeypatch.setenv(library.CACHE_ENV, str(tmp_path))
    load_cpu_kernels.cache_clear()
    yield
    load_cpu_kernels.cache_clear()


@pytest.mark.parametrize("switch", library.SWITCH_ENVS)
def test_switched_off_or_no_compiler_keeps_the_torch_backend(
    switch: str, fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv(switch, "torch")
    assert load_cpu_kernels() is None
    assert resolve_attention_backend("auto", cpu, torch.float32) == "torch"
    monkeypatch.delenv(switch)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    load_cpu_kernels.cache_clear()
    assert load_cpu_kernels() is None
    with pytest.raises(ConfigError, match="needs a CPU device"):
        resolve_attention_backend("cpu", cpu, torch.float32)


def test_auto_picks_the_kernel_for_its_dtypes(kernel: CpuPagedAttention) -> None:
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu, torch.bfloat16) == "cpu"
    assert resolve_attention_backend("auto", cpu, torch.float16) == "torch"
    assert resolve_attention_backend("torch", cpu, torch.float32) == "torch"
    with pytest.raises(ConfigError, match="float32 or bfloat16"):
        resolve_attention_backend("cpu", cpu, torch.float16)


def test_the_cpu_runner_runs_the_kernel_with_the_rotary_fused(
    kernel: CpuPagedAttention, tiny_model: LoadedModel
) -> None:
    if tiny_model.device.type != "cpu":
        pytest.skip("the CPU backend")
    runner = ModelRunner(
        tiny_model.model,
        device=tiny_model.device,
        dtype=tiny_model.dtype,
        max_model_len=64,
        max_num_reqs=2,
        block_size=4,
    )
    rotary = tiny_model.model.model.rotary
    assert runner.attention_backend == "cpu"
    for layer in tiny_model.model.attention_layers():
        assert layer.ops.ops.attention_op.name == "cpu"
        assert layer.rotates and layer.rotary[0] is rotary
