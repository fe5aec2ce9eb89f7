"""The fused Triton kernels (residual add + RMSNorm, the per-head q/k norms,
rotary embedding, silu and mul, rotary + KV-cache store) against the torch layers in
``asyncstep.models.layers`` and the unfused kernels: float32 to 1e-5, bfloat16
to within one rounding of a float32 computation; strided q/k (column slices of a
fused qkv), hidden sizes that are not powers of two, and the ValueErrors.

On the CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``,
set before triton is imported); ``ASYNCSTEP_TEST_DEVICE=cuda`` compiles them.
The interpreter truncates float32 -> bfloat16 (compiled kernels round to
nearest even), so the bfloat16 bounds are one ulp there and half an ulp on GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from asyncstep.models.layers.norm import RMSNorm  # noqa: E402
from asyncstep.models.layers.rotary import RotaryEmbedding  # noqa: E402
from asyncstep.ops.torch_ref import TorchOps  # noqa: E402
from asyncstep.ops.triton.attention import store_kv_cache  # noqa: E402
from asyncstep.ops.triton.fused import (  # noqa: E402
    fused_add_rms_norm,
    qk_rms_norm,
    silu_and_mul,
)
from asyncstep.ops.triton.rotary import rotary_and_store_kv, rotary_embedding  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but CUDA is unavailable", allow_module_level=True)

#: Relative bound of one float32 -> bfloat16 rounding (plus float32 noise).
BF16_RTOL = (2.0**-8 if DEVICE.type == "cuda" else 2.0**-7) * 1.01
EPS = 1e-5


def assert_rounded_once(actual: torch.Tensor, exact: torch.Tensor) -> None:
    """``actual`` (bfloat16) is ``exact`` (float32) rounded once."""
    assert actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual.float(), exact, rtol=BF16_RTOL, atol=1e-6)


def make_norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, EPS, dtype=dtype).to(DEVICE)
    norm.weight.data.uniform_(0.5, 1.5)
    return norm


# -- fused_add_rms_norm --------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 576, 96])
def test_add_rms_norm_float32(hidden: int) -> None:
    norm = make_norm(hidden, torch.float32)
    x = torch.randn(5, hidden, device=DEVICE)
    residual = torch.randn(5, hidden, device=DEVICE) * 3
    out, residual_out = fused_add_rms_norm(x, residual, norm.weight, EPS)
    want_out, want_residual = norm.forward_residual(x, residual)
    torch.testing.assert_close(residual_out, want_residual, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    assert out.dtype == residual_out.dtype == torch.float32


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_bfloat16(weight_dtype: torch.dtype) -> None:
    hidden = 576
    norm = make_norm(hidden, weight_dtype)
    x = torch.randn(6, hidden, device=DEVICE).bfloat16()
    residual = (torch.randn(6, hidden, device=DEVICE) * 4).bfloat16()
    out, residual_out = fused_add_rms_norm(x, residual, norm.weight, EPS)
    assert out.dtype == residual_out.dtype == torch.bfloat16
    exact_residual = x.float() + residual.float()
    assert_rounded_once(residual_out, exact_residual)
    if DEVICE.type == "cuda":  # round to nearest even, as torch's bf16 add
        assert torch.equal(residual_out, residual + x)
    # The norm is of the residual as stored.
    r = residual_out.float()
    exact = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * norm.weight.float()
    assert_rounded_once(out, exact)
    want_out, want_residual = norm.forward_residual(x, residual)
    torch.testing.assert_close(residual_out, want_residual, rtol=2.0**-7, atol=0)
    # Within two ulps (torch may round before applying a float32 weight).
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2.0**-6, atol=1e-6)


def test_add_rms_norm_strided_rows() -> None:
    hidden = 48
    norm = make_norm(hidden, torch.float32)
    wide = torch.randn(4, 3 * hidden, device=DEVICE)
    x, residual = wide[:, hidden : 2 * hidden], wide[:, 2 * hidden :]
    before = wide.clone()
    out, residual_out = fused_add_rms_norm(x, residual, norm.weight, EPS)
    want_out, want_residual = norm.forward_residual(x, residual)
    torch.testing.assert_close(residual_out, want_residual, rtol=0, atol=1e-6)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    assert torch.equal(wide, before)  # the inputs are not modified
    assert out.is_contiguous() and residual_out.is_contiguous()


def test_add_rms_norm_no_tokens() -> None:
    norm = make_norm(32, torch.float32)
    empty = torch.empty(0, 32, device=DEVICE)
    out, residual_out = fused_add_rms_norm(empty, empty, norm.weight, EPS)
    assert out.shape == residual_out.shape == (0, 32)


def test_add_rms_norm_rejects_bad_inputs() -> None:
    x = torch.randn(3, 32, device=DEVICE)
    weight = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="residual shape"):
        fused_add_rms_norm(x, torch.randn(3, 16, device=DEVICE), weight, EPS)
    with pytest.raises(ValueError, match="residual dtype"):
        fused_add_rms_norm(x, x.bfloat16(), weight, EPS)
    with pytest.raises(ValueError, match="weight shape"):
        fused_add_rms_norm(x, x, torch.ones(16, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="2-D"):
        fused_add_rms_norm(x[None], x[None], weight, EPS)
    with pytest.raises(ValueError, match="unit last stride"):
        fused_add_rms_norm(x, torch.randn(32, 3, device=DEVICE).t(), weight, EPS)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fused_add_rms_norm(x.long(), x.long(), weight, EPS)


# -- qk_rms_norm ---------------------------------------------------------------


def per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: ``F.rms_norm`` over each head of ``x [T, H * D]``, in float32."""
    heads = x.float().view(x.shape[0], -1, weight.shape[0])
    return F.rms_norm(heads, weight.shape, weight.float(), EPS).view(x.shape)


@pytest.mark.parametrize(("head_dim", "heads"), [(16, (6, 2)), (24, (3, 3)), (128, (4, 1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_rms_norm_on_qkv_slices(
    dtype: torch.dtype, head_dim: int, heads: tuple[int, int]
) -> None:
    """q and k column slices of a fused qkv output (strided rows), each head
    normed with its weight: float32 to 1e-5, bfloat16 one rounding of the
    float32 norm; new contiguous outputs, the input untouched."""
    q_size, kv_size = heads[0] * head_dim, heads[1] * head_dim
    qkv = (torch.randn(5, q_size + 2 * kv_size, device=DEVICE) * 3).to(dtype)
    before = qkv.clone()
    q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
    q_weight = torch.rand(head_dim, device=DEVICE) + 0.5
    k_weight = (torch.rand(head_dim, device=DEVICE) + 0.5).to(dtype)
    q_out, k_out = qk_rms_norm(q, k, q_weight, k_weight, EPS)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.is_contiguous() and k_out.is_contiguous() and torch.equal(qkv, before)
    for got, x, w in ((q_out, q, q_weight), (k_out, k, k_weight)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, per_head(x, w), rtol=1e-5, atol=1e-5)
        else:
            assert_rounded_once(got, per_head(x, w))


def test_qk_rms_norm_through_the_op_sets() -> None:
    """The Triton op set: one kernel on CUDA, the reference's two norms
    elsewhere (the same bits as TorchOps there); TorchOps: its rms_norm."""
    from asyncstep.ops.triton import TritonOps
    from asyncstep.ops.triton.paged_attention import TritonAttention

    qkv = torch.randn(3, 8 * 16, device=DEVICE).bfloat16()
    q, k = qkv[:, : 6 * 16], qkv[:, 6 * 16 : 7 * 16]
    q_weight = (torch.rand(16, device=DEVICE) + 0.5).bfloat16()
    k_weight = (torch.rand(16, device=DEVICE) + 0.5).bfloat16()
    args = (q, k, q_weight, k_weight, EPS)
    want = TorchOps().qk_rms_norm(*args, float32_residual=False)
    for got, x, w in zip(want, (q, k), (q_weight, k_weight), strict=True):
        assert torch.equal(got, F.rms_norm(x.view(3, -1, 16), (16,), w, EPS).view(x.shape))
    got = TritonOps(TritonAttention(rotates=True)).qk_rms_norm(*args, float32_residual=False)
    kernel = qk_rms_norm(*args) if DEVICE.type == "cuda" else want
    assert torch.equal(got[0], kernel[0]) and torch.equal(got[1], kernel[1])


def test_qk_rms_norm_no_tokens_and_bad_inputs() -> None:
    empty = torch.empty(0, 32, device=DEVICE)
    weight = torch.ones(16, device=DEVICE)
    q_out, k_out = qk_rms_norm(empty, empty[:, :16], weight, weight, EPS)
    assert q_out.shape == (0, 32) and k_out.shape == (0, 16)
    q = torch.randn(3, 32, device=DEVICE)
    with pytest.raises(ValueError, match="whole heads"):
        qk_rms_norm(q, q[:, :24], weight, weight, EPS)
    with pytest.raises(ValueError, match="whole heads"):
        qk_rms_norm(q, q, weight, torch.ones(8, device=DEVICE), EPS)
    with pytest.raises(ValueError, match="does not match"):
        qk_rms_norm(q, q.bfloat16(), weight, weight, EPS)
    with pytest.raises(ValueError, match="unit last stride"):
        qk_rms_norm(q, torch.randn(32, 3, device=DEVICE).t(), weight, weight, EPS)


# -- rotary_embedding ----------------------------------------------------------

HEADS, KV_HEADS = 4, 2


def fused_qkv(
    tokens: int, head_dim: int, dtype: torch.dtype, heads: tuple[int, int] = (HEADS, KV_HEADS)
) -> torch.Tensor:
    width = (heads[0] + 2 * heads[1]) * head_dim
    return (torch.randn(tokens, width, device=DEVICE) * 2).to(dtype)


def split(
    qkv: torch.Tensor, head_dim: int, heads: tuple[int, int] = (HEADS, KV_HEADS)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_end, k_end = heads[0] * head_dim, (heads[0] + heads[1]) * head_dim
    return qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]


def exact_rotary(x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """neox rotary in float32 (cos/sin not rounded)."""
    cos, sin = rope.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    x = x.float().view(x.shape[0], -1, rope.head_dim)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(1)


@pytest.mark.parametrize(
    ("head_dim", "heads"),
    [(16, (HEADS, KV_HEADS)), (24, (HEADS, KV_HEADS)), (64, (9, 3))],  # (64, (9, 3)): SmolLM2
)
def test_rotary_float32_in_place_on_qkv_slices(head_dim: int, heads: tuple[int, int]) -> None:
    rope = RotaryEmbedding(head_dim, 128, 10000.0).to(DEVICE)
    qkv = fused_qkv(5, head_dim, torch.float32, heads)
    positions = torch.tensor([0, 7, 3, 127, 64], device=DEVICE)
    q, k, v = split(qkv, head_dim, heads)
    want_q, want_k = rope(rope.cos_sin(positions, torch.float32), q.clone(), k.clone())
    v_before = v.clone()
    out_q, out_k = rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=0, atol=1e-5)
    assert torch.equal(v, v_before)  # v, next to k in the same rows, untouched


def test_rotary_bfloat16_llama3_scaling() -> None:
    head_dim = 32
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    rope = RotaryEmbedding(head_dim, 256, 500000.0, scaling).to(DEVICE)
    qkv = fused_qkv(6, head_dim, torch.bfloat16)
    positions = torch.tensor([1, 255, 100, 0, 17, 200], device=DEVICE)
    q, k, _ = split(qkv, head_dim)
    exact_q, exact_k = exact_rotary(q, positions, rope), exact_rotary(k, positions, rope)
    want_q, want_k = rope(rope.cos_sin(positions, torch.bfloat16), q.clone(), k.clone())
    rotary_embedding(positions.int(), q, k, rope.cos_sin_cache, head_dim)
    assert_rounded_once(q, exact_q)
    assert_rounded_once(k, exact_k)
    # The torch layer rounds cos/sin to bfloat16 first: a few ulps apart.
    torch.testing.assert_close(q, want_q, rtol=2.0**-4, atol=2.0**-4)
    torch.testing.assert_close(k, want_k, rtol=2.0**-4, atol=2.0**-4)


def test_rotary_no_tokens() -> None:
    rope = RotaryEmbedding(16, 8, 10000.0).to(DEVICE)
    q, k = torch.empty(0, 64, device=DEVICE), torch.empty(0, 32, device=DEVICE)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert rotary_embedding(positions, q, k, rope.cos_sin_cache, 16) == (q, k)


def test_rotary_rejects_bad_inputs() -> None:
    head_dim = 16
    cache = RotaryEmbedding(head_dim, 8, 10000.0).to(DEVICE).cos_sin_cache
    q, k = torch.randn(3, 4 * head_dim, device=DEVICE), torch.randn(3, 2 * head_dim, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cases: list[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]]] = [
        ("k dtype", (pos, q, k.bfloat16(), cache, head_dim)),
        ("number of tokens", (pos[:2], q, k, cache, head_dim)),
        ("number of tokens", (pos, q, k[:2], cache, head_dim)),
        ("positions must be", (pos.float(), q, k, cache, head_dim)),
        ("not a multiple of head_dim", (pos, q[:, :40], k, cache, head_dim)),
        ("positive and even", (pos, q, k, cache, 15)),
        ("cos_sin_cache must be \\[max_pos, 8\\]", (pos, q, k, cache, 8)),
        ("float32", (pos, q, k, cache.bfloat16(), head_dim)),
        ("unit last stride", (pos, q.t().contiguous().t(), k, cache, head_dim)),
    ]
    for message, args in cases:
        with pytest.raises(ValueError, match=message):
            rotary_embedding(*args)


# -- silu_and_mul --------------------------------------------------------------


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


@pytest.mark.parametrize("d", [64, 96, 1536])
def test_silu_and_mul_float32_strided(d: int) -> None:
    wide = torch.randn(5, 3 * d, device=DEVICE) * 3
    x = wide[:, d:]  # strided rows: [tokens, 2 * d] out of [tokens, 3 * d]
    before = wide.clone()
    out = silu_and_mul(x)
    assert out.shape == (5, d) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, torch_silu_and_mul(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(wide, before)


def test_silu_and_mul_bfloat16() -> None:
    x = (torch.randn(4, 2 * 1536, device=DEVICE) * 3).bfloat16()
    out = silu_and_mul(x)
    assert_rounded_once(out, torch_silu_and_mul(x.float()))
    # torch rounds after the silu and after the product: within two ulps.
    torch.testing.assert_close(out, torch_silu_and_mul(x), rtol=2.0**-6, atol=1e-6)


def test_silu_and_mul_no_tokens_and_bad_inputs() -> None:
    assert silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)
    with pytest.raises(ValueError, match="odd"):
        silu_and_mul(torch.randn(2, 33, device=DEVICE))
    with pytest.raises(ValueError, match="2-D"):
        silu_and_mul(torch.randn(2, 2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="unit last stride"):
        silu_and_mul(torch.randn(8, 3, device=DEVICE).t())
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int64, device=DEVICE))


# -- rotary_and_store_kv -------------------------------------------------------

NUM_BLOCKS, BLOCK_SIZE = 5, 4


def random_cache(kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    shape = (2, kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim)
    return torch.randn(shape, device=DEVICE).to(dtype)


def random_slots(tokens: int, padding: int) -> torch.Tensor:
    """Distinct random slots for ``tokens`` tokens, ``padding`` of them -1, and
    two extra entries past the tokens (never read)."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[: tokens + 2]
    slots[torch.randperm(tokens)[:padding]] = -1
    return slots.to(DEVICE)


def unfused_rotary_and_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    rope: RotaryEmbedding,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    heads: tuple[int, int],
) -> None:
    q, k, v = split(qkv, rope.head_dim, heads)
    rotary_embedding(positions, q, k, rope.cos_sin_cache, rope.head_dim)
    kv_shape = (qkv.shape[0], heads[1], rope.head_dim)
    store_kv_cache(k.view(kv_shape), v.view(kv_shape), kv_cache, slots)


@pytest.mark.parametrize(
    ("head_dim", "heads", "dtype"),
    [
        (16, (HEADS, KV_HEADS), torch.float32),
        (24, (4, 1), torch.float32),  # GQA 4/1, half a head not a power of two
        (64, (9, 3), torch.float32),  # SmolLM2
        (32, (HEADS, KV_HEADS), torch.bfloat16),
    ],
)
def test_rotary_and_store_kv_matches_unfused(
    head_dim: int, heads: tuple[int, int], dtype: torch.dtype
) -> None:
    tokens = 7
    rope = RotaryEmbedding(head_dim, 128, 10000.0).to(DEVICE)
    positions = torch.randint(0, 128, (tokens,), device=DEVICE)
    slots = random_slots(tokens, padding=2)
    qkv = fused_qkv(tokens, head_dim, dtype, heads)
    kv_cache = random_cache(heads[1], head_dim, dtype)
    want_qkv, want_cache = qkv.clone(), kv_cache.clone()
    unfused_rotary_and_store(want_qkv, positions, rope, want_cache, slots, heads)

    cache_before = kv_cache.clone()
    q, k, v = split(qkv, head_dim, heads)
    rotary_and_store_kv(positions, q, k, v, rope.cos_sin_cache, head_dim, kv_cache, slots)
    # q and k rotated in place, v untouched: the whole qkv equals the unfused one.
    # (The same float32 math: equal up to float32 noise, which may flip a bf16 rounding.)
    rtol = 0.0 if dtype == torch.float32 else BF16_RTOL
    torch.testing.assert_close(qkv, want_qkv, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(kv_cache, want_cache, rtol=rtol, atol=1e-6)
    # The written slots hold the rotated k and v; the others keep their values.
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    valid = slots[:tokens] >= 0
    written[slots[:tokens][valid]] = True
    flat = kv_cache.view(2, heads[1], -1, head_dim)
    flat_before = cache_before.view(2, heads[1], -1, head_dim)
    assert torch.equal(flat[:, :, ~written], flat_before[:, :, ~written])
    token_slots = slots[:tokens][valid]
    kv_view = (tokens, heads[1], head_dim)
    for i, x in enumerate((k, v)):
        stored = flat[i][:, token_slots].transpose(0, 1)
        assert torch.equal(stored, x.reshape(kv_view)[valid])


def test_rotary_and_store_kv_no_tokens() -> None:
    rope = RotaryEmbedding(16, 8, 10000.0).to(DEVICE)
    q, k = torch.empty(0, 64, device=DEVICE), torch.empty(0, 32, device=DEVICE)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    kv_cache = random_cache(2, 16, torch.float32)
    before = kv_cache.clone()
    slots = torch.empty(0, dtype=torch.int64, device=DEVICE)
    rotary_and_store_kv(positions, q, k, k, rope.cos_sin_cache, 16, kv_cache, slots)
    assert torch.equal(kv_cache, before)


def test_rotary_and_store_kv_rejects_bad_inputs() -> None:
    head_dim = 16
    cache = RotaryEmbedding(head_dim, 8, 10000.0).to(DEVICE).cos_sin_cache
    q, k = torch.randn(3, 4 * head_dim, device=DEVICE), torch.randn(3, 2 * head_dim, device=DEVICE)
    v = torch.randn(3, 2 * head_dim, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    kv = random_cache(2, head_dim, torch.float32)
    slots = torch.arange(3, device=DEVICE)
    cases: list[tuple[str, dict[str, torch.Tensor | int]]] = [
        ("k dtype", {"k": k.bfloat16()}),
        ("positive and even", {"head_dim": 15}),
        ("number of tokens", {"positions": pos[:2]}),
        ("v shape", {"v": v[:, :head_dim]}),
        ("v dtype", {"v": v.bfloat16()}),
        ("v must have unit last stride", {"v": v.t().contiguous().t()}),
        ("kv_cache shape", {"kv_cache": kv[:, :1]}),
        ("kv_cache shape", {"kv_cache": kv[0]}),
        ("kv_cache dtype", {"kv_cache": kv.bfloat16()}),
        (
            "kv_cache must have unit last stride",
            {"kv_cache": random_cache(2, 32, torch.float32)[..., ::2]},
        ),
        ("slot_mapping must be 1-D int64", {"slot_mapping": slots.int()}),
        ("slot_mapping must be 1-D int64", {"slot_mapping": slots[None]}),
        ("2 entries for 3 tokens", {"slot_mapping": slots[:2]}),
    ]
    base: dict[str, torch.Tensor | int] = {
        "positions": pos,
        "q": q,
        "k": k,
        "v": v,
        "cos_sin_cache": cache,
        "head_dim": head_dim,
        "kv_cache": kv,
        "slot_mapping": slots,
    }
    for message, change in cases:
        with pytest.raises(ValueError, match=message):
            rotary_and_store_kv(**(base | change))  # type: ignore[arg-type]
