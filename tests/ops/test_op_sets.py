"""Every op set against the reference (:mod:`asyncstep.ops.torch_ref`), op
by op: RMSNorm, the residual add + RMSNorm (the stream started or given, given
up or kept, float32 or in the activations' dtype), ``silu(gate) * up`` and the
rotary embedding, in float32 to 1e-5 and in bfloat16 to one rounding; and
the choice of op set. The CPU library's op set where it builds (its ops are
bit for bit, :mod:`tests.models.test_cpu_layer_ops`); the Triton op set under
the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is
imported), which rounds float32 -> bfloat16 by truncation: one ulp."""

from __future__ import annotations

import os
from copy import deepcopy

#: The op sets' tensors live on the CPU: the Triton op set runs interpreted
#: (on CUDA, tests/gpu/test_triton_fused.py runs its kernels compiled). Set
#: only there: a CUDA run's engine processes inherit the environment.
INTERPRETED = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu") == "cpu"
if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from asyncstep.models.layers.rotary import RotaryEmbedding  # noqa: E402
from asyncstep.ops import TORCH_OPS, OpSet, select_ops  # noqa: E402
from asyncstep.ops.attention import AttentionMetadata, AttentionShape  # noqa: E402
from asyncstep.ops.cpu.library import load_cpu_kernels  # noqa: E402
from asyncstep.ops.select import triton_available  # noqa: E402
from asyncstep.ops.torch_attention import TORCH_ATTENTION  # noqa: E402

CPU = torch.device("cpu")
EPS = 1e-5
#: A float32 -> bfloat16 rounding (one ulp: the interpreter truncates).
BF16_RTOL = 2.0**-7 * 1.01


def op_set(name: str) -> OpSet:
    if name == "cpu":
        kernels = load_cpu_kernels()
        if kernels is None:
            pytest.skip("the CPU library does not build here")
        from asyncstep.ops.cpu.ops import CpuOps
        from asyncstep.ops.cpu.paged_attention import CpuAttention

        return CpuOps(kernels.layer_ops, CpuAttention(kernels.attention))
    if not triton_available():
        pytest.skip("needs triton")
    if not INTERPRETED:
        pytest.skip("CPU tensors: the Triton op set runs interpreted (CUDA: tests/gpu)")
    from asyncstep.ops.triton import TritonOps
    from asyncstep.ops.triton.paged_attention import TritonAttention

    return TritonOps(TritonAttention(rotates=True))


@pytest.fixture(params=["cpu", "triton"])
def ops(request: pytest.FixtureRequest) -> OpSet:
    return op_set(request.param)


def assert_close(ops: OpSet, got: torch.Tensor, want: torch.Tensor, want32: torch.Tensor) -> None:
    """``got`` against the reference: ``want`` in the same dtypes (the CPU
    library's ops round where torch's do), or for a fused kernel (one
    rounding of its float32 math) ``want32``, the reference in float32."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif ops.name == "triton":
        atol = BF16_RTOL * float(want32.abs().max())  # values that cancel to near zero
        torch.testing.assert_close(got.float(), want32.float(), rtol=BF16_RTOL, atol=atol)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=BF16_RTOL, atol=1e-6)


def f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def float32_residual_cases(ops: OpSet) -> list[bool]:
    """The residual-stream modes an op set serves (CUDA's stream is in the
    activations' dtype; the CPU's bf16 models keep it in float32)."""
    return [False] if ops.name == "triton" else [False, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(ops: OpSet, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    for f32_stream in float32_residual_cases(ops):
        weight = (torch.rand(96, generator=gen) + 0.5).to(torch.float32 if f32_stream else dtype)
        got = ops.rms_norm(x, weight, EPS, float32_residual=f32_stream)
        want = TORCH_OPS.rms_norm(x, weight, EPS, float32_residual=f32_stream)
        want32 = TORCH_OPS.rms_norm(x.float(), weight.float(), EPS, float32_residual=False)
        assert_close(ops, got, want, want32)
        heads, head_weight = x.view(5, 6, 16), weight[:16].contiguous()  # Qwen3's q and k norms
        got = ops.rms_norm(heads, head_weight, EPS, float32_residual=f32_stream)
        want = TORCH_OPS.rms_norm(heads, head_weight, EPS, float32_residual=f32_stream)
        want32 = TORCH_OPS.rms_norm(heads.float(), head_weight.float(), EPS, float32_residual=False)
        assert_close(ops, got, want, want32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("own_residual", [False, True])
def test_add_rms_norm(ops: OpSet, dtype: torch.dtype, own_residual: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 80, generator=gen).to(dtype)
    for f32_stream in float32_residual_cases(ops):
        stream = torch.float32 if f32_stream else dtype
        weight = (torch.rand(80, generator=gen) + 0.5).to(stream)
        residual = torch.randn(7, 80, generator=gen).to(stream)
        for given in (None, residual):
            kept = None if given is None else given.clone()
            mine = None if given is None else given.clone()
            out, res = ops.add_rms_norm(
                x, mine, weight, EPS, float32_residual=f32_stream, own_residual=own_residual
            )
            want_out, want_res = TORCH_OPS.add_rms_norm(
                x, kept, weight, EPS, float32_residual=f32_stream, own_residual=False
            )
            out32, res32 = TORCH_OPS.add_rms_norm(
                x.float(),
                f32(kept),
                weight.float(),
                EPS,
                float32_residual=False,
                own_residual=False,
            )
            assert_close(ops, out, want_out, out32)
            assert_close(ops, res, want_res, res32)
            if mine is not None and given is not None and not own_residual:
                assert torch.equal(mine, given)  # a residual not given up is left as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(ops: OpSet, dtype: torch.dtype) -> None:
    gate_up = torch.randn(6, 2 * 136, generator=torch.Generator().manual_seed(2)).to(dtype)
    want32 = TORCH_OPS.silu_and_mul(gate_up.float())
    assert_close(ops, ops.silu_and_mul(gate_up), TORCH_OPS.silu_and_mul(gate_up), want32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary(ops: OpSet, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    cache = RotaryEmbedding(32, 128, 10000.0).cos_sin_cache
    positions = torch.tensor([0, 5, 17, 100, 127])
    q = torch.randn(5, 4 * 32, generator=gen).to(dtype)
    k = torch.randn(5, 2 * 32, generator=gen).to(dtype)
    got_q, got_k = ops.rotary(
        ops.rotary_cos_sin(cache, positions, dtype), q.clone(), k.clone(), cache, 32
    )
    want_q, want_k = TORCH_OPS.rotary(
        TORCH_OPS.rotary_cos_sin(cache, positions, dtype), q.clone(), k.clone(), cache, 32
    )
    q32, k32 = TORCH_OPS.rotary(
        TORCH_OPS.rotary_cos_sin(cache, positions, torch.float32), q.float(), k.float(), cache, 32
    )
    assert_close(ops, got_q, want_q, q32)
    assert_close(ops, got_k, want_k, k32)


def test_the_choice() -> None:
    """The Triton op set where attention is Triton and the fused kernels are
    on (CUDA's default batch-invariant one: tests/gpu/test_triton_invariant.py);
    the CPU library's on the CPU with the fused kernels, where it builds;
    else the reference's layer ops (on the CPU with the CPU's float32 LM
    head: its precision, not a fused kernel)."""
    plain = select_ops(CPU, "torch", fused_kernels=False)
    assert plain.name == "cpu-head" and plain.attention_op is TORCH_ATTENTION
    if load_cpu_kernels() is not None:
        beside = select_ops(CPU, "cpu", fused_kernels=False)  # the reference's layer ops
        assert beside.name == "cpu-head" and beside.attention_op.name == "cpu"
        assert beside.rotates_in_kv_store
    cpu = select_ops(CPU, "cpu", fused_kernels=True)
    assert cpu.name == ("cpu-head" if load_cpu_kernels() is None else "cpu")
    assert select_ops(CPU, "torch", fused_kernels=True).attention_op is TORCH_ATTENTION
    if triton_available():
        cuda = torch.device("cuda")
        triton = select_ops(cuda, "triton", fused_kernels=True, batch_invariant=False)
        assert triton.name == "triton" and triton.rotates_in_kv_store
        # Packed weights or experts: the Triton op set (the invariant one has no packed path).
        packed = select_ops(cuda, "triton", fused_kernels=True, dense_16_bit=False)
        assert packed.name == "triton"
        # The fused kernels asked away: the reference's layer ops, by default not invariant.
        unfused = select_ops(cuda, "triton", fused_kernels=False)
        assert unfused.name == "torch" and unfused.attention_op.name == "triton"
        assert not unfused.rotates_in_kv_store  # the reference's rotary, then the store
    # The torch attention on CUDA: by default the reference, not the invariant op set.
    assert select_ops(torch.device("cuda"), "torch", fused_kernels=True) is TORCH_OPS


def test_the_cpu_lm_head_writes_float32_logits_with_or_without_the_fused_kernels() -> None:
    """A bfloat16 head on the CPU: float32 logits, the library's (each row
    summed in float32), whether the layer ops are fused or not; the
    reference's bfloat16-rounded logits would tie top tokens."""
    if load_cpu_kernels() is None:
        pytest.skip("needs the CPU library (a C compiler)")
    torch.manual_seed(0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    weight = torch.randn(100, 64, dtype=torch.bfloat16)
    want = x.float() @ weight.float().T
    for fused in (False, True):
        logits = select_ops(CPU, "cpu", fused_kernels=fused).logits(x, weight, None)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-4)


def test_a_copied_model_has_a_slot_of_its_own() -> None:
    """Every layer of a model calls one slot; a deep copy's layers call one
    slot of their own, holding the same op set (never copied)."""
    from asyncstep.models.dummy import get_shape
    from asyncstep.models.layers.norm import RMSNorm
    from asyncstep.models.llama import LlamaForCausalLM, LlamaMLP

    model = LlamaForCausalLM(get_shape("tiny-llama"), torch.float32)
    chosen = select_ops(CPU, "cpu", fused_kernels=True)
    model.use_ops(chosen)

    def slots(m: LlamaForCausalLM) -> set[int]:
        layers = [x for x in m.modules() if isinstance(x, RMSNorm | LlamaMLP)]
        return {id(x.ops) for x in [*layers, m.model.rotary]}

    copy = deepcopy(model)
    assert slots(model) == {id(model.model.ops)} and slots(copy) == {id(copy.model.ops)}
    assert copy.model.ops is not model.model.ops and copy.model.ops.ops is chosen


# -- attention (rotary + KV store + paged attention) and linear ------------------


def attention_step(
    dtype: torch.dtype, seed: int, *, decodes_only: bool = False
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Two decodes over cached keys and a prompt chunk over its prefix
    (block size 4, 3 requests; ``decodes_only``: a third decode), and a
    KV cache of 2 KV heads x 16."""
    from asyncstep.ops.attention import kv_cache_shape, plan_decode_buckets

    query_lens, computed = [1, 1, 1 if decodes_only else 5], [6, 3, 4]
    seq_lens = np.array([q + c for q, c in zip(query_lens, computed, strict=True)], np.int32)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    blocks_per_req = 4
    block_table = torch.arange(3 * blocks_per_req, dtype=torch.int32).view(3, blocks_per_req)
    positions = torch.cat(
        [torch.arange(c, c + q) for q, c in zip(query_lens, computed, strict=True)]
    )
    # Request r's blocks are 4r .. 4r + 3: its token at position p goes to slot 16 r + p.
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens))
    slots = rows * blocks_per_req * 4 + positions
    meta = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]),
        num_decodes=3 if decodes_only else 2,
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=block_table,
        slot_mapping=slots,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        positions=positions,
    )
    decodes = meta.num_decodes
    meta.decode_buckets = plan_decode_buckets(
        seq_lens[:decodes], block_table[:decodes], 4, min_bucket=1
    )
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(kv_cache_shape(3 * blocks_per_req, 4, 2, 16), dtype=dtype)
    cache.normal_(generator=gen)  # the cached prefixes' keys and values
    return meta, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention(ops: OpSet, dtype: torch.dtype) -> None:
    """The op set's rotary + KV store + paged attention against the
    reference's rotary then the reference's store and attention: the same
    cache and the same output (the rotation of the op's own store where it
    rotates). The Triton kernels' bfloat16 needs CUDA (the interpreter's
    dot does not take it), as in tests/gpu/test_triton_attention.py."""
    if ops.name == "triton" and dtype == torch.bfloat16:
        pytest.skip("the Triton attention in bfloat16 runs on CUDA only")
    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    rotary = RotaryEmbedding(16, 64, 10000.0)
    meta, cache = attention_step(dtype, seed=6)
    want_meta, want_cache = attention_step(dtype, seed=6)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(meta.num_actual_tokens, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    q, k, v = qkv.split([64, 32, 32], -1)
    positions = meta.positions
    assert positions is not None
    if ops.rotates_in_kv_store:
        got = ops.attention(q.clone(), k.clone(), v, cache, meta, shape, rotary.cos_sin_cache)
    else:
        rq, rk = ops.rotary(
            ops.rotary_cos_sin(rotary.cos_sin_cache, positions, dtype),
            q.clone(),
            k.clone(),
            rotary.cos_sin_cache,
            16,
        )
        got = ops.attention(rq, rk, v, cache, meta, shape, None)
    cos_sin = TORCH_OPS.rotary_cos_sin(rotary.cos_sin_cache, positions, dtype)
    wq, wk = TORCH_OPS.rotary(cos_sin, q.clone(), k.clone(), rotary.cos_sin_cache, 16)
    want = TORCH_OPS.attention(wq, wk, v, want_cache, want_meta, shape, None)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(cache, want_cache, **tol)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("decodes_only", [True, False])
def test_an_attention_that_norms_qk_takes_them_un_normed(decodes_only: bool) -> None:
    """The Triton attention with the fused decode applies the shape's
    per-head q/k norms (Qwen3) itself: inside the split-KV kernel for a
    decode batch, one kernel before the store otherwise; the same cache and
    output as the reference's norms, rotary, store and attention."""
    from asyncstep.ops.attention import QkNorm
    from asyncstep.ops.triton import TritonOps
    from asyncstep.ops.triton.paged_attention import TritonAttention

    op_set("triton")  # skips where the interpreter does not run
    ops = TritonOps(TritonAttention(rotates=True, fused_decode=True), fused_decode=True)
    assert ops.attention_op.norms_qk
    gen = torch.Generator().manual_seed(8)
    q_weight, k_weight = torch.rand(2, 16, generator=gen) + 0.5
    shape = AttentionShape(4, 2, 16, 0.25, qk_norm=QkNorm(q_weight, k_weight, EPS))
    rotary = RotaryEmbedding(16, 64, 10000.0)
    meta, cache = attention_step(torch.float32, seed=6, decodes_only=decodes_only)
    want_meta, want_cache = attention_step(torch.float32, seed=6, decodes_only=decodes_only)
    qkv = torch.randn(meta.num_actual_tokens, (4 + 2 + 2) * 16, generator=gen)
    q, k, v = qkv.split([64, 32, 32], -1)
    got = ops.attention(q.clone(), k.clone(), v, cache, meta, shape, rotary.cos_sin_cache)
    positions = meta.positions
    assert positions is not None
    nq, nk = TORCH_OPS.qk_rms_norm(q, k, q_weight, k_weight, EPS, float32_residual=False)
    cos_sin = TORCH_OPS.rotary_cos_sin(rotary.cos_sin_cache, positions, torch.float32)
    wq, wk = TORCH_OPS.rotary(cos_sin, nq, nk, rotary.cos_sin_cache, 16)
    want = TORCH_OPS.attention(wq, wk, v, want_cache, want_meta, shape, None)
    torch.testing.assert_close(cache, want_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_linear_and_logits(ops: OpSet, rows: int) -> None:
    """A dense weight and a packed one (its format's own matmul) as the
    reference multiplies them; the logits at least as precise."""
    from asyncstep.ops.packed import pack_int8_rows

    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    for packed in (None, pack_int8_rows(weight, torch.float32, max_tokens=8)):
        got = ops.linear(x, weight, packed, bias)
        want = TORCH_OPS.linear(x, weight, packed, bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        logits = ops.logits(x, weight, packed)
        torch.testing.assert_close(
            logits.float(), TORCH_OPS.logits(x, weight, packed).float(), rtol=1e-5, atol=1e-5
        )
