"""Sliding-window attention op by op: the torch reference and the CPU
library's kernel against dense windowed attention in float64, with the
window smaller than the context, decodes mixed with prompt chunks, and the
blocks before each request's window poisoned (as the KV cache manager frees
them: an op that read one would show it); the Triton ops' are in
``tests/gpu/test_triton_sliding_window.py``."""

from __future__ import annotations

import pytest
import torch

from asyncstep.errors import ConfigError, UnsupportedModelError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.layers.attention import plan_decode_buckets
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.ops.attention import AttentionShape
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.paged_attention import CpuAttention
from asyncstep.ops.torch_attention import TORCH_ATTENTION, TorchAttention
from asyncstep.ops.torch_ref import TorchOps
from asyncstep.runner.kv_cache_binding import check_draft_windows
from asyncstep.runner.model_runner import ModelRunner
from tests.models.test_cpu_attention import PagedStep, make_step, tolerance

#: Decodes of ragged lengths, a prompt with no prefix longer than the
#: window, chunks after a cached prefix shorter and longer than the window.
QUERY_LENS = [1, 1, 1, 1, 1, 19, 6, 11]
COMPUTED = [3, 30, 45, 9, 70, 0, 40, 5]


def windowed_dense(step: PagedStep, window: int) -> torch.Tensor:
    """Each request's queries over the keys of their windows, in float64."""
    qsl, outs = step.meta.query_start_loc_cpu, []
    for r, (k, v) in enumerate(zip(step.full_k, step.full_v, strict=True)):
        q = step.q[qsl[r] : qsl[r + 1]].double().view(-1, step.heads, step.dim)
        group = step.heads // k.shape[1]
        k = k.double().repeat_interleave(group, 1)
        v = v.double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * step.scale
        q_len, seq = q.shape[0], k.shape[0]
        ones = torch.ones(q_len, seq, dtype=torch.bool)
        mask = ones.tril(seq - q_len) & ones.triu(seq - q_len - window + 1)
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1))
    return torch.cat(outs)


def poison_freed_blocks(
    step: PagedStep, window: int, block: int, computed: list[int] = COMPUTED
) -> None:
    """Point each request's blocks wholly before its first query's window
    at a block of huge keys and values (the manager frees those);
    ``computed``: each request's cached tokens before the step."""
    held = set(step.meta.block_table.flatten().tolist())
    poison = next(b for b in range(step.kv_cache.shape[2]) if b not in held)
    step.kv_cache[:, :, poison] = 1e4 * torch.randn_like(step.kv_cache[:, :, poison])
    for r, num_computed in enumerate(computed):
        freed = max(num_computed - window + 1, 0) // block
        step.meta.block_table[r, :freed] = poison


def windowed_step(dtype: torch.dtype, window: int, block: int) -> PagedStep:
    step = make_step(
        QUERY_LENS, COMPUTED, heads=6, kv_heads=2, dim=32, block=block, dtype=dtype, seed=3
    )
    poison_freed_blocks(step, window, block)
    return step


def run_op(op: object, step: PagedStep, window: int) -> torch.Tensor:
    shape = AttentionShape(step.heads, step.k.shape[1] // step.dim, step.dim, step.scale, window)
    meta = step.meta
    meta.decode_buckets = plan_decode_buckets(
        meta.seq_lens_cpu[: meta.num_decodes], meta.block_table, step.kv_cache.shape[3], 2, 1
    )
    return op(step.q, step.k, step.v, step.kv_cache, meta, shape, None)  # type: ignore[operator]


@pytest.mark.parametrize(("window", "block"), [(8, 4), (5, 4), (1, 4), (16, 16)])
def test_reference_matches_dense_windowed_attention(window: int, block: int) -> None:
    step = windowed_step(torch.float32, window, block)
    out = run_op(TORCH_ATTENTION, step, window)
    torch.testing.assert_close(out.double(), windowed_dense(step, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "block"), [(8, 4), (5, 4), (1, 4), (70, 16)])
def test_cpu_kernel_matches_dense_windowed_attention(
    dtype: torch.dtype, window: int, block: int
) -> None:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU kernels do not build here (no C compiler)")
    step = windowed_step(dtype, window, block)
    out = run_op(CpuAttention(kernels.attention), step, window)
    torch.testing.assert_close(out.double(), windowed_dense(step, window), **tolerance(dtype))


def tiny_model(window: int | None, layers: int = 1, **changes: object) -> LlamaForCausalLM:
    config = ModelArchConfig(
        architecture="MistralForCausalLM",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=window,
    ).replace(**changes)
    return LlamaForCausalLM(config)


class _NoWindowAttention(TorchAttention):
    name = "no-window"
    supports_sliding_window = False


def test_an_op_set_without_windows_is_refused_by_a_windowed_model() -> None:
    tiny_model(None).use_ops(TorchOps(_NoWindowAttention()))
    with pytest.raises(UnsupportedModelError, match="'no-window' attention op does not"):
        tiny_model(4).use_ops(TorchOps(_NoWindowAttention()))


def test_a_draft_model_must_attend_within_the_targets_window() -> None:
    mistral = tiny_model(8)
    check_draft_windows(mistral, tiny_model(8), 1)
    check_draft_windows(mistral, tiny_model(4), 1)
    check_draft_windows(tiny_model(None), tiny_model(None), 1)
    with pytest.raises(ConfigError, match="a draft model must attend within it"):
        check_draft_windows(mistral, tiny_model(None), 1)
    mixed = tiny_model(8, 2, layer_types=("sliding_attention", "full_attention"))
    with pytest.raises(ConfigError, match="mix sliding-window and full attention"):
        check_draft_windows(mixed, tiny_model(4), 2)


def test_runner_binds_one_tensor_per_group_position() -> None:
    """Two groups (sliding, full) of two layers: layers at the same position
    of their groups share a tensor, and a block spans two layers; a model of
    one group keeps a tensor per layer, in layer order."""
    types = ("sliding_attention", "full_attention", "full_attention", "sliding_attention")
    mixed = tiny_model(8, 4, layer_types=types)
    runner = ModelRunner(
        mixed, device=torch.device("cpu"), dtype=torch.float32, max_model_len=64,
        max_num_reqs=2, block_size=4,
    )  # fmt: skip
    runner.initialize_kv_cache(10)
    layers = mixed.attention_layers()
    assert [a.kv_cache_group for a in layers] == [1, 0, 0, 1]
    assert layers[0].kv_cache is layers[1].kv_cache and layers[2].kv_cache is layers[3].kv_cache
    assert len(runner.kv_caches) == 2
    assert runner.kv_cache_block_bytes() == 2 * (2 * 1 * 8) * 4 * 4
    full = tiny_model(None, 3)
    runner = ModelRunner(
        full, device=torch.device("cpu"), dtype=torch.float32, max_model_len=64,
        max_num_reqs=2, block_size=4,
    )  # fmt: skip
    runner.initialize_kv_cache(10)
    bound = [id(a.kv_cache) for a in full.attention_layers()]
    assert bound == [id(t) for t in runner.kv_caches] and len(set(bound)) == 3
    assert runner.kv_cache_block_bytes() == 3 * (2 * 1 * 8) * 4 * 4
