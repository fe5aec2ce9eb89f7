"""The CPU library's layer ops against the torch expressions they replace:
residual add + RMSNorm over a float32 residual stream (the first layer's
form too, and per-head norms), and ``silu(gate) * up``; on random rows of
several shapes (one row, odd widths, strided rows), float32 and bfloat16,
one and two threads. Then their wiring: the norm and the MLP use them where
the runner switches them on, torch's ops where the library is off or does
not take the input, and a residual the model did not make is never
written.

On x86 every result is torch's, bit for bit (``cpu_layer_ops`` says how);
elsewhere a float32 result is within a few float32 ulps and a bfloat16 one
within one bfloat16 ulp of torch's. The residual stream is bitwise equal
everywhere (one float32 add per value)."""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncstep.config import CompilationConfig
from asyncstep.datatypes import IntermediateTensors
from asyncstep.models.layers.attention import AttentionMetadata, kv_cache_shape
from asyncstep.models.layers.norm import RMSNorm
from asyncstep.models.llama import LlamaForCausalLM, LlamaMLP
from asyncstep.models.model_loader import LoadedModel, settle_dtype
from asyncstep.ops import TORCH_OPS, OpSet, OpSetSlot, select_ops
from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.layer_ops import CpuLayerOps
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.ops import CpuOps
from asyncstep.runner.model_runner import ModelRunner

EPS = 1e-5
#: A bfloat16 ulp is 2^-8..2^-7 of the value: one ulp apart passes.
BF16_ONE_ULP = {"rtol": 2**-7, "atol": 1e-30}
FP32_FEW_ULPS = {"rtol": 1e-5, "atol": 1e-6}
DTYPES = [torch.float32, torch.bfloat16]
#: Where the ops are torch's bit for bit.
BITWISE = platform.machine().lower() in ("x86_64", "amd64")


def assert_same_as_torch(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit on x86 (NaN where torch has NaN), else to the tolerance."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if BITWISE:
        same = (got == expected) | (got.isnan() & expected.isnan())
        assert bool(same.all()), f"{int((~same).sum())} of {got.numel()} values differ"
    else:
        tol = BF16_ONE_ULP if got.dtype == torch.bfloat16 else FP32_FEW_ULPS
        torch.testing.assert_close(got, expected, equal_nan=True, **tol)


@pytest.fixture(scope="module")
def ops() -> CpuLayerOps:
    loaded = load_cpu_kernels()
    if loaded is None:
        pytest.skip("the CPU kernels do not build here (no C compiler)")
    return loaded.layer_ops


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def strided_rows(rows: int, width: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Random rows whose row stride exceeds their width (a slice of wider rows)."""
    return (torch.randn(rows, width + 5) * scale).to(dtype)[:, 2 : 2 + width]


def torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward_residual`` in float32_residual mode, as torch runs it."""
    r = x.float() if residual is None else residual + x
    return F.rms_norm(r, weight.shape, weight, EPS).to(x.dtype), r


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# -- add + RMSNorm ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (5, 7), (64, 576), (3, 1)])
@pytest.mark.parametrize("first_layer", [True, False])
def test_add_rms_norm_matches_torch(
    ops: CpuLayerOps, dtype: torch.dtype, rows: int, hidden: int, first_layer: bool
) -> None:
    x = strided_rows(rows, hidden, dtype, scale=3.0)
    residual = None if first_layer else torch.randn(rows, hidden) * 20
    weight = torch.rand(hidden) + 0.5
    before = None if residual is None else residual.clone()
    out, r = ops.add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_r = torch_add_rms_norm(x, before, weight)
    assert torch.equal(r, expected_r)
    assert out.is_contiguous()
    assert_same_as_torch(out, expected_out)
    if residual is not None:
        assert torch.equal(residual, before), "out of place: the residual is not written"


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_in_place_writes_the_residual_it_returns(
    ops: CpuLayerOps, dtype: torch.dtype
) -> None:
    x = torch.randn(9, 576).to(dtype)
    residual = torch.randn(9, 576)
    weight = torch.rand(576)
    expected_out, expected_r = torch_add_rms_norm(x, residual.clone(), weight)
    out, r = ops.add_rms_norm(x, residual, weight, EPS, in_place=True)
    assert r is residual
    assert torch.equal(residual, expected_r)
    assert_same_as_torch(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_calls_split_over_threads_give_the_same_bits(
    ops: CpuLayerOps, dtype: torch.dtype, two_threads: None
) -> None:
    """Rows past the size where the ops fork (2^18 values, a silu value worth
    4): every row is one thread's, so the thread count changes nothing."""
    x, residual, weight = torch.randn(600, 576).to(dtype), torch.randn(600, 576), torch.rand(576)
    gate_up = torch.randn(200, 2 * 1536).to(dtype)
    two = ops.add_rms_norm(x, residual, weight, EPS)[0], ops.silu_and_mul(gate_up)
    torch.set_num_threads(1)
    one = ops.add_rms_norm(x, residual, weight, EPS)[0], ops.silu_and_mul(gate_up)
    assert torch.equal(two[0], one[0]) and torch.equal(two[1], one[1])
    torch.set_num_threads(2)  # torch's ops on two threads too
    assert_same_as_torch(one[0], torch_add_rms_norm(x, residual, weight)[0])
    assert_same_as_torch(one[1], torch_silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norms_of_strided_rows(ops: CpuLayerOps, dtype: torch.dtype) -> None:
    """``forward``'s form: ``[tokens, heads, head_dim]`` views of a wider
    projection output (Qwen3's q/k norms), and plain rows."""
    qkv = torch.randn(6, 3 * 4 * 16).to(dtype)
    q = qkv[:, : 4 * 16].view(6, 4, 16)
    weight = torch.rand(16) + 0.5
    assert ops.takes_vectors(q) and not ops.takes_vectors(q.transpose(0, 1))
    expected = F.rms_norm(q.float(), (16,), weight, EPS).to(dtype)
    assert_same_as_torch(ops.rms_norm(q, weight, EPS), expected)
    rows = qkv[:, :16]
    expected = F.rms_norm(rows.float(), (16,), weight, EPS).to(dtype)
    assert_same_as_torch(ops.rms_norm(rows, weight, EPS), expected)


def test_add_rms_norm_refuses_what_it_cannot_read(ops: CpuLayerOps) -> None:
    x, weight = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(ValueError, match="rows"):
        ops.add_rms_norm(x.t(), None, weight, EPS)
    with pytest.raises(ValueError, match="rows"):
        ops.add_rms_norm(x.half(), None, weight, EPS)
    with pytest.raises(ValueError, match="residual"):
        ops.add_rms_norm(x, torch.randn(4, 8).bfloat16(), weight, EPS)
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(x, None, torch.ones(9), EPS)
    with pytest.raises(ValueError, match="in_place"):
        ops.add_rms_norm(x, None, weight, EPS, in_place=True)


# -- silu * up ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "d"), [(1, 1536), (7, 5), (64, 96), (3, 100)])
def test_silu_and_mul_matches_torch(
    ops: CpuLayerOps, dtype: torch.dtype, rows: int, d: int
) -> None:
    """Widths that torch's vector loop takes whole, and with a scalar tail;
    values where exp saturates, overflows or is NaN."""
    gate_up = strided_rows(rows, 2 * d, dtype, scale=4.0)
    special = [0.0, -100.0, 100.0, -104.5, 105.0, float("nan"), float("inf"), -float("inf")]
    gate_up[0, : min(d, len(special))] = torch.tensor(special[:d], dtype=dtype)
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (rows, d)
    assert_same_as_torch(out, torch_silu_and_mul(gate_up))


def test_silu_and_mul_refuses_an_odd_width(ops: CpuLayerOps) -> None:
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.randn(2, 7))


# -- wiring ---------------------------------------------------------------------------


def library_ops() -> OpSet:
    """The CPU op set where the library loads (else the reference)."""
    return select_ops(torch.device("cpu"), "torch", fused_kernels=True)


def cpu_norm(hidden: int, *, kernel: bool) -> RMSNorm:
    norm = RMSNorm(hidden, EPS, ops=OpSetSlot(library_ops() if kernel else TORCH_OPS))
    norm.weight.data = torch.rand(hidden) + 0.5
    norm.float32_residual = True
    return norm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_norm_module_with_and_without_the_kernel(ops: CpuLayerOps, dtype: torch.dtype) -> None:
    """bf16 through the kernel, as torch's ops compute it; float16 (not the
    kernel's) through torch's ops."""
    with_kernel, torch_only = cpu_norm(64, kernel=True), cpu_norm(64, kernel=False)
    torch_only.weight.data = with_kernel.weight.data
    x, residual = torch.randn(3, 64).to(dtype), torch.randn(3, 64)
    got = with_kernel.forward_residual(x, residual.clone())
    expected = torch_only.forward_residual(x, residual.clone())
    assert torch.equal(got[1], expected[1])
    if dtype == torch.float16:
        assert torch.equal(got[0], expected[0]) and torch.equal(with_kernel(x), torch_only(x))
    else:
        assert_same_as_torch(got[0], expected[0])
        assert_same_as_torch(with_kernel(x), torch_only(x))


def test_a_float32_model_s_norms_take_the_kernel(
    ops: CpuLayerOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 model's stream is float32 without the 16-bit models'
    ``float32_residual``: its norms (with a residual, without, per head)
    take the library's kernel too, as torch computes them."""
    with_kernel, torch_only = cpu_norm(64, kernel=True), cpu_norm(64, kernel=False)
    for norm in (with_kernel, torch_only):
        norm.float32_residual = False  # a float32 model's, as loaded
    torch_only.weight.data = with_kernel.weight.data
    calls: list[str] = []
    for name in ("rms_norm", "add_rms_norm"):
        kernel = getattr(ops, name)
        monkeypatch.setattr(
            ops, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw)
        )
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    got = with_kernel.forward_residual(x, residual.clone())
    expected = torch_only.forward_residual(x, residual.clone())
    assert torch.equal(got[1], expected[1])
    assert_same_as_torch(got[0], expected[0])
    assert_same_as_torch(with_kernel(x), torch_only(x))
    heads = torch.randn(3, 4, 64)  # per-head q/k norms: row groups
    library = with_kernel.ops.ops
    assert_same_as_torch(
        library.rms_norm(heads, with_kernel.weight, EPS, float32_residual=False),
        TORCH_OPS.rms_norm(heads, with_kernel.weight, EPS, float32_residual=False),
    )
    if isinstance(library, CpuOps):  # the library loads here
        assert calls == ["add_rms_norm", "rms_norm", "rms_norm"]


def test_the_norm_writes_in_place_only_a_residual_given_up(ops: CpuLayerOps) -> None:
    norm = cpu_norm(32, kernel=True)
    x, residual = torch.randn(2, 32).bfloat16(), torch.randn(2, 32)
    kept = residual.clone()
    _, r = norm.forward_residual(x, residual)
    assert r is not residual and torch.equal(residual, kept)
    _, r = norm.forward_residual(x, residual, own_residual=True)
    assert r is residual and torch.equal(residual, kept + x)


@pytest.fixture
def library_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The library switched off (``load_cpu_kernels`` returns None)."""
    monkeypatch.setenv(library.SWITCH_ENVS[0], "torch")
    load_cpu_kernels.cache_clear()
    yield
    load_cpu_kernels.cache_clear()


def test_without_the_library_the_modules_run_torch(library_off: None) -> None:
    norm = cpu_norm(16, kernel=True)
    x, residual = torch.randn(3, 16).bfloat16(), torch.randn(3, 16)
    out, r = norm.forward_residual(x, residual, own_residual=True)
    expected_out, expected_r = torch_add_rms_norm(x, residual, norm.weight)
    assert torch.equal(out, expected_out) and torch.equal(r, expected_r)
    assert r is not residual
    mlp = small_mlp(kernel=True)
    hidden = torch.randn(3, 16)
    expected = mlp.down_proj(torch_silu_and_mul(mlp.gate_up_proj(hidden)))
    assert torch.equal(mlp(hidden), expected)


def small_mlp(*, kernel: bool) -> LlamaMLP:
    from asyncstep.models.dummy import get_shape

    arch = dataclasses.replace(get_shape("tiny-llama"), hidden_size=16, intermediate_size=24)
    mlp = LlamaMLP(arch, torch.float32, ops=OpSetSlot(library_ops() if kernel else TORCH_OPS))
    for param in mlp.parameters():
        param.data = torch.randn(param.shape) / 4
    return mlp


def test_the_mlp_with_the_kernel(ops: CpuLayerOps) -> None:
    mlp = small_mlp(kernel=True)
    hidden = torch.randn(5, 16)
    expected = mlp.down_proj(torch_silu_and_mul(mlp.gate_up_proj(hidden)))
    assert_same_as_torch(mlp(hidden), expected)


def test_the_cpu_runner_switches_the_kernels_with_fused_kernels(
    ops: CpuLayerOps, tiny_model: LoadedModel
) -> None:
    if tiny_model.device.type != "cpu":
        pytest.skip("the CPU kernels")
    model = tiny_model.model

    def switched() -> set[str]:
        return {m.ops.ops.name for m in model.modules() if isinstance(m, RMSNorm | LlamaMLP)}

    for fused in (False, True):
        compilation = CompilationConfig(fused_kernels=fused)
        runner = ModelRunner(
            model,
            device=tiny_model.device,
            dtype=tiny_model.dtype,
            max_model_len=64,
            max_num_reqs=2,
            block_size=4,
            compilation=compilation,
        )
        assert isinstance(runner.ops, CpuOps) is fused
        assert switched() == {"cpu" if fused else "cpu-head"}


# -- the model -------------------------------------------------------------------------


def prefill_metadata(tokens: int, block_size: int) -> AttentionMetadata:
    """One request's prompt of ``tokens`` tokens in blocks 0, 1, ..."""
    qsl = np.array([0, tokens], dtype=np.int32)
    num_blocks = -(-tokens // block_size)
    return AttentionMetadata(
        num_actual_tokens=tokens,
        num_decodes=0,
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_table=torch.arange(num_blocks, dtype=torch.int32)[None],
        slot_mapping=torch.arange(tokens),
        max_query_len=tokens,
        max_seq_len=tokens,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=np.array([tokens]),
    )


@pytest.fixture(scope="module")
def bf16_tiny() -> LlamaForCausalLM:
    """The tiny Llama's random weights in bfloat16 with a float32 residual
    stream (as the loader settles a CPU model), its KV caches bound."""
    from asyncstep.models.dummy import dummy_weights, get_shape

    arch = get_shape("tiny-llama")
    model = LlamaForCausalLM(arch, torch.float32)
    model.load_weights(dummy_weights(arch, seed=0, device=torch.device("cpu")))
    settle_dtype(model, torch.bfloat16)
    shape = kv_cache_shape(4, 16, arch.num_key_value_heads, arch.head_dim)
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(shape, dtype=torch.bfloat16)
    return model


def run_layers(model: LlamaForCausalLM, kernels: bool, intermediate: IntermediateTensors) -> Any:
    """The decoder layers and final norm on ``intermediate``, as a later
    pipeline stage runs them (the embedding's output comes in as received)."""
    model.use_ops(library_ops() if kernels else TORCH_OPS)
    tokens = intermediate["hidden_states"].shape[0]
    inner, embed = model.model, model.model.embed_tokens
    inner.embed_tokens = None
    try:
        ids, positions = torch.zeros(tokens, dtype=torch.long), torch.arange(tokens)
        return inner(ids, positions, prefill_metadata(tokens, 16), intermediate)
    finally:
        inner.embed_tokens = embed


def test_the_model_with_the_kernels_leaves_a_received_residual_alone(
    ops: CpuLayerOps, bf16_tiny: LlamaForCausalLM
) -> None:
    """Whole layers with and without the kernels agree (bf16; on x86 bit for
    bit), and the residual received from a previous stage is read, never
    written."""
    ids = torch.randint(3, 512, (21,))
    assert bf16_tiny.model.embed_tokens is not None
    hidden = bf16_tiny.model.embed_tokens(ids)
    residual = torch.randn(21, hidden.shape[1])
    received = residual.clone()
    outs = [
        run_layers(
            bf16_tiny, kernels, IntermediateTensors({"hidden_states": hidden, "residual": residual})
        )
        for kernels in (True, False)
    ]
    assert torch.equal(residual, received)
    if BITWISE:
        assert torch.equal(outs[0], outs[1])
    else:
        torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=0.05, atol=0.05)
