"""Weights kept 4-bit on the GPU (``asyncstep.ops.triton.quant`` and
``asyncstep.models.layers.gpu_quant``): the Q4 and Q8 layouts round-trip,
the GEMVs, the dequantizing GEMM and the dequantize kernel equal the float64
product with the dequantized reference weight (float32 to 1e-6 / 1e-5;
float16 / bfloat16 within their rounding), odd shapes, strided rows and x
from 1e-12 to 1e9 in magnitude included; the GEMVs' int8 path (opt-in,
``int8_x``, 16-bit x only) equals the product with x quantized per block
(to 1e-5), blocks of zeros included; GGUF Q4_0 / Q4_1 / Q8_0 weights
pack losslessly, other weights not at all; layers packed while a model
loads keep their dense weight too, take the packed copy for one-row steps
only, and compute what their dense, rounded weights do.

On the CPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported), which multiplies
bfloat16 tiles wrongly in ``tl.dot``: the GEMM's bfloat16 case runs on CUDA
only (``ASYNCSTEP_TEST_DEVICE=cuda``, which also runs a whole engine on a
4-bit model against its dense twin).
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

from asyncstep.models.layers.gpu_quant import (  # noqa: E402
    packing_on_load,
    round_decoder_weights,
    round_to_q4_1,
    round_to_q8_0,
)
from asyncstep.ops.triton.quant import (  # noqa: E402
    GROUP_SIZE,
    GemvConfig,
    dequantize_q4,
    dequantize_q4_reference,
    dequantize_q8_reference,
    pack_q4,
    pack_q8,
    q4_dot,
    q4_gemv,
    q4_matmul,
    q8_gemv,
    q8_matmul,
)
from asyncstep.ops.triton.quant_weight import (  # noqa: E402
    GpuQ4Weight,
    GpuQ8Weight,
    pack_q4_gpu,
    pack_q8_gpu,
)

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but CUDA is unavailable", allow_module_level=True)

#: Relative error of one rounding to the dtype (the interpreter truncates
#: float32 -> bfloat16: a whole ulp), plus float32 noise.
ROUNDING = {
    torch.float32: 1e-5,
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-8 if DEVICE.type == "cuda" else 2.0**-7,
}
#: The GEMM also rounds each dequantized weight to x's dtype before multiplying.
DOT_ERROR = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DOT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def random_q4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qweight, scales, w)``: random codes, scales and offsets packed, and
    the float32 weight they stand for (from the codes, not the kernel's layout)."""
    groups = k // GROUP_SIZE
    codes = torch.randint(0, 16, (n, k), device=DEVICE)
    scale = (torch.rand(n, groups, device=DEVICE) * 0.1 + 0.01).half()
    offset = (torch.randn(n, groups, device=DEVICE) * 0.2).half()
    qweight, scales = pack_q4(codes, scale, offset)
    w = codes.float().reshape(n, groups, GROUP_SIZE) * scale.float()[..., None]
    return qweight, scales, (w + offset.float()[..., None]).reshape(n, k)


def random_q8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`random_q4` for the 8-bit layout (codes -128..127)."""
    groups = k // GROUP_SIZE
    codes = torch.randint(-128, 128, (n, k), device=DEVICE)
    scale = (torch.rand(n, groups, device=DEVICE) * 0.01 + 1e-3).half()
    qweight, scales = pack_q8(codes, scale)
    w = codes.float().reshape(n, groups, GROUP_SIZE) * scale.float()[..., None]
    return qweight, scales, w.reshape(n, k)


def rel_error(actual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    exact = x.double() @ w.double().T
    return float((actual.double() - exact).norm() / exact.norm())


# -- layout --------------------------------------------------------------------


def test_the_layout_round_trips() -> None:
    qweight, scales, w = random_q4(8, 96)
    assert qweight.shape == (8, 48) and qweight.dtype == torch.uint8
    assert scales.shape == (8, 3, 2) and scales.dtype == torch.float16
    torch.testing.assert_close(dequantize_q4_reference(qweight, scales), w, rtol=0, atol=0)


def test_nibble_s_of_word_t_is_feature_4s_plus_t() -> None:
    codes = torch.zeros(1, 32, dtype=torch.int64, device=DEVICE)
    codes[0, 4 * 5 + 2] = 9  # feature 22: nibble 5 of word 2
    ones = torch.ones(1, 1, device=DEVICE)
    qweight, _ = pack_q4(codes, ones, ones * 0)
    words = qweight.view(torch.int32)[0]
    assert words.tolist() == [0, 0, 9 << 20, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel(dtype: torch.dtype) -> None:
    qweight, scales, w = random_q4(20, 160)  # 20 rows, 5 blocks: partial tiles both ways
    out = dequantize_q4(qweight, scales, dtype)
    assert out.dtype == dtype and out.shape == w.shape
    torch.testing.assert_close(out.float(), w, rtol=ROUNDING[dtype], atol=1e-6)


# -- GEMV ------------------------------------------------------------------------


def test_q8_layout_round_trips() -> None:
    qweight, scales, w = random_q8(8, 96)
    assert qweight.shape == (8, 96) and qweight.dtype == torch.uint8
    assert scales.shape == (8, 3, 2) and scales.dtype == torch.float16
    torch.testing.assert_close(dequantize_q8_reference(qweight, scales), w, rtol=0, atol=0)
    codes = torch.zeros(1, 32, dtype=torch.int64, device=DEVICE)
    codes[0, 8 * 3 + 5] = 9  # feature 29: byte 3 of word 5, stored + 128
    qweight, _ = pack_q8(codes, torch.ones(1, 1, device=DEVICE))
    words = qweight.view(torch.int32)[0].tolist()
    assert words[5] == (128 | 128 << 8 | 128 << 16 | 137 << 24) - (1 << 32)
    assert all(word == 0x80808080 - (1 << 32) for i, word in enumerate(words) if i != 5)


# (rows of the weight, K, config): unmasked (every tile full) and masked launches.
GEMV_CASES = [
    (40, 192, GemvConfig(block_n=8, block_g=2, num_warps=1)),  # even tiles
    (40, 192, GemvConfig(block_n=16, block_g=4, num_warps=4)),  # partial tiles both ways
    (40, 192, GemvConfig(block_n=16, block_g=4, num_warps=2, prefetch=False)),
    (40, 192, GemvConfig(block_n=8, block_g=2, num_warps=1, prefetch=False, stages=3)),
]


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize(("n", "k", "config"), GEMV_CASES)
def test_gemv_float32(rows: int, n: int, k: int, config: GemvConfig) -> None:
    qweight, scales, w = random_q4(n, k)
    x = torch.randn(rows, k, device=DEVICE)
    out = q4_gemv(x, qweight, scales, config)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert rel_error(out, x, w) < 1e-6


@pytest.mark.parametrize("magnitude", [1e-12, 1e-3, 1e4, 1e9])
def test_gemv_is_exact_over_the_range_of_x(magnitude: float) -> None:
    # The codes meet x scaled by up to 2**88: no overflow below 2**40 (1.1e12),
    # and no subnormal products above 2**-60 (8.7e-19).
    qweight, scales, w = random_q4(16, 256)
    x = torch.randn(1, 256, device=DEVICE) * magnitude
    assert rel_error(q4_gemv(x, qweight, scales), x, w) < 1e-6
    qweight, scales, w = random_q8(16, 256)
    assert rel_error(q8_gemv(x, qweight, scales), x, w) < 1e-6


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("n", "k", "config"), GEMV_CASES)
def test_q8_gemv_float32(rows: int, n: int, k: int, config: GemvConfig) -> None:
    qweight, scales, w = random_q8(n, k)
    x = torch.randn(rows, k, device=DEVICE)
    out = q8_gemv(x, qweight, scales, config)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert rel_error(out, x, w) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_rounds_once_to_x_dtype(dtype: torch.dtype, bits: int) -> None:
    qweight, scales, w = (random_q4 if bits == 4 else random_q8)(24, 128)
    x = torch.randn(2, 128, device=DEVICE).to(dtype)
    gemv = q4_gemv if bits == 4 else q8_gemv
    out = gemv(x, qweight, scales, GemvConfig(block_n=8, block_g=2))
    assert out.dtype == dtype
    exact = (x.double() @ w.double().T).float()
    torch.testing.assert_close(out.float(), exact, rtol=ROUNDING[dtype], atol=1e-3)


def int8_x(x: torch.Tensor) -> torch.Tensor:
    """x as the GEMV's int8 path reads it (``asyncstep.ops.triton.quant_packed``):
    per block of 32, ``dx * round(x / dx)`` with ``dx = max|x| / 127``
    (float32; a block below 1e-30 reads as zeros)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, GROUP_SIZE)
    amax = blocks.abs().amax(-1, keepdim=True)
    big = amax > 1e-30
    inv = torch.where(big, 127 / torch.where(big, amax, 1.0), 0.0)
    dx = torch.where(big, amax / 127, 0.0)
    return (torch.round(blocks * inv) * dx).reshape(x.shape)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("n", "k", "config"), GEMV_CASES)
def test_gemv_int8_x_is_the_product_with_x_quantized_per_block(
    bits: int, rows: int, n: int, k: int, config: GemvConfig
) -> None:
    qweight, scales, w = (random_q4 if bits == 4 else random_q8)(n, k)
    x = torch.randn(rows, k, device=DEVICE) * torch.rand(1, k // GROUP_SIZE, 1, device=DEVICE).mul(
        100
    ).repeat_interleave(GROUP_SIZE, -1).reshape(1, k)
    x[0, GROUP_SIZE : 2 * GROUP_SIZE] = 0.0  # a block of zeros: zeros, no NaN
    x[-1, :GROUP_SIZE] = 1e-31  # below the smallest scale: zeros too
    out = (q4_gemv if bits == 4 else q8_gemv)(x, qweight, scales, config._replace(int8=True))
    assert out.dtype == torch.float32 and bool(out.isfinite().all())
    assert rel_error(out, int8_x(x), w) < 1e-5
    assert rel_error(out, x, w) < 2e-2  # int8 x: ~0.5 % for random x


@pytest.mark.parametrize("bits", [4, 8])
def test_16_bit_x_takes_the_int8_path_only_when_asked(bits: int) -> None:
    qweight, scales, w = (random_q4 if bits == 4 else random_q8)(24, 256)
    x = torch.randn(2, 256, device=DEVICE)
    gemv = q4_gemv if bits == 4 else q8_gemv
    matmul = q4_matmul if bits == 4 else q8_matmul
    exact = (x.bfloat16().double() @ w.double().T).float()
    quantized = (int8_x(x.bfloat16()).double() @ w.double().T).float()
    # float32 x: exact, int8_x or not
    assert rel_error(gemv(x, qweight, scales, int8_x=True), x, w) < 1e-6
    for out in (gemv(x.bfloat16(), qweight, scales), matmul(x[:1].bfloat16(), qweight, scales)):
        rows = out.shape[0]
        torch.testing.assert_close(
            out.float(), exact[:rows], rtol=ROUNDING[torch.bfloat16], atol=1e-3
        )
    for out in (
        gemv(x.bfloat16(), qweight, scales, int8_x=True),
        matmul(x[:1].bfloat16(), qweight, scales, int8_x=True),
    ):
        rows = out.shape[0]
        torch.testing.assert_close(
            out.float(), quantized[:rows], rtol=ROUNDING[torch.bfloat16], atol=1e-3
        )
    assert not torch.equal(
        gemv(x.bfloat16(), qweight, scales), gemv(x.bfloat16(), qweight, scales, int8_x=True)
    )


def test_gemv_reads_strided_rows_and_keeps_leading_dims() -> None:
    qweight, scales, w = random_q4(16, 64)
    wide = torch.randn(3, 100, device=DEVICE)
    x = wide[:, 10:74]  # row stride 100
    out = q4_gemv(x, qweight, scales, GemvConfig(block_n=16, block_g=2))
    assert rel_error(out, x, w) < 1e-6
    x3 = torch.randn(2, 1, 64, device=DEVICE)
    assert q4_gemv(x3, qweight, scales).shape == (2, 1, 16)


# -- GEMM --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("swap", [True, False])
def test_dot(dtype: torch.dtype, swap: bool) -> None:
    qweight, scales, w = random_q4(48, 192)
    x = torch.randn(19, 192, device=DEVICE).to(dtype)  # two row tiles of 16
    out = q4_dot(x, qweight, scales, block_m=16, block_n=32, block_g=4, swap=swap)
    assert out.shape == (19, 48) and out.dtype == dtype
    assert rel_error(out, x, w) < DOT_ERROR[dtype]


def test_dot_without_the_magic_conversion() -> None:
    qweight, scales, w = random_q4(32, 128)
    x = torch.randn(4, 128, device=DEVICE)
    out = q4_dot(x, qweight, scales, block_n=16, block_g=4, magic=False)
    assert rel_error(out, x, w) < 1e-5


# -- dispatch and checks -------------------------------------------------------------


def test_matmul_takes_each_path_and_adds_the_bias(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncstep.ops.triton.quant as tq

    monkeypatch.setattr(tq, "GEMV_MAX_M", 2)
    monkeypatch.setattr(tq, "DOT_MAX_M", 4)
    qweight, scales, w = random_q4(32, 64)
    bias = torch.randn(32, device=DEVICE)
    for rows in (0, 1, 3, 6):  # none, GEMV, GEMM, dequantize + matmul
        x = torch.randn(rows, 64, device=DEVICE)
        out = q4_matmul(x, qweight, scales, bias)
        assert out.shape == (rows, 32)
        torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_q8_matmul_takes_each_path_and_adds_the_bias() -> None:
    qweight, scales, w = random_q8(32, 64)
    bias = torch.randn(32, device=DEVICE)
    for rows in (0, 1, 3):  # none, GEMV, dequantize + matmul
        x = torch.randn(rows, 64, device=DEVICE)
        out = q8_matmul(x, qweight, scales, bias)
        assert out.shape == (rows, 32)
        torch.testing.assert_close(out, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_gemv(torch.zeros(1, 48, device=DEVICE), qweight[:, :48].contiguous(), scales)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"x": torch.zeros(2, 48)}, "last dimension"),
        ({"x": torch.zeros(2, 64, dtype=torch.int32)}, "float32, float16 or bfloat16"),
        ({"qweight": torch.zeros(8, 30, dtype=torch.uint8)}, "multiple of 16"),
        ({"qweight": torch.zeros(8, 32, dtype=torch.int8)}, "contiguous uint8"),
        ({"scales": torch.zeros(8, 2, 2)}, "float16"),
        ({"scales": torch.zeros(8, 1, 2, dtype=torch.float16)}, r"\(8, 2, 2\)"),
    ],
)
def test_bad_arguments_raise(change: dict[str, torch.Tensor], match: str) -> None:
    qweight, scales, _ = random_q4(8, 64)
    args = {"x": torch.zeros(2, 64), "qweight": qweight, "scales": scales}
    args.update({k: v.to(DEVICE) for k, v in change.items()})
    with pytest.raises(ValueError, match=match):
        q4_matmul(args["x"].to(DEVICE), args["qweight"], args["scales"])


# -- packing a model's weights -----------------------------------------------------------


def q4_1_weight(rows: int, cols: int) -> torch.Tensor:
    """As a GGUF Q4_1 tensor dequantizes: float16 scale and minimum per block,
    codes 0 and 15 present."""
    blocks = cols // GROUP_SIZE
    d = (torch.rand(rows, blocks, 1, device=DEVICE) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(rows, blocks, 1, device=DEVICE) * 0.1).half().float()
    q = torch.randint(0, 16, (rows, blocks, GROUP_SIZE), device=DEVICE).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(rows, cols)


def q4_0_weight(rows: int, cols: int) -> torch.Tensor:
    """As a GGUF Q4_0 tensor: ``d * (q - 8)``, code 0 at the largest magnitude."""
    blocks = cols // GROUP_SIZE
    d = (torch.rand(rows, blocks, 1, device=DEVICE) * 0.02 + 1e-3).half().float()
    q = torch.randint(0, 15, (rows, blocks, GROUP_SIZE), device=DEVICE).float()
    q[..., 0] = 0
    return (d * (q - 8)).reshape(rows, cols)


def test_gguf_4_bit_weights_pack_losslessly() -> None:
    weight = torch.cat([q4_1_weight(16, 128), q4_0_weight(16, 128)])
    packed = pack_q4_gpu(weight)
    assert isinstance(packed, GpuQ4Weight) and packed.kind == "q4_gpu"
    assert packed.nbytes == 32 * 64 + 32 * 4 * 4
    # The stored scales and offsets give back every value exactly.
    torch.testing.assert_close(
        dequantize_q4_reference(packed.data, packed.scales), weight, rtol=0, atol=0
    )
    x = torch.randn(1, 128, device=DEVICE)
    assert packed.applies(x) and not packed.applies(torch.randn(2, 128, device=DEVICE))
    torch.testing.assert_close(packed.mm(x), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_gguf_8_bit_weights_pack_losslessly_and_round_to_them() -> None:
    blocks = 4
    d = (torch.rand(16, blocks, 1, device=DEVICE) * 0.01 + 1e-4).half().float()
    q = torch.randint(-127, 128, (16, blocks, GROUP_SIZE), device=DEVICE).float()
    q[..., 0] = 127 * torch.sign(torch.randn(16, blocks, device=DEVICE))  # as llama.cpp's
    weight = (d * q).reshape(16, blocks * GROUP_SIZE)
    packed = pack_q8_gpu(weight)
    assert isinstance(packed, GpuQ8Weight) and packed.kind == "q8_gpu"
    assert packed.nbytes == 16 * 128 + 16 * blocks * 4
    torch.testing.assert_close(
        dequantize_q8_reference(packed.data, packed.scales), weight, rtol=0, atol=0
    )
    x = torch.randn(1, 128, device=DEVICE)
    assert packed.applies(x) and not packed.applies(torch.randn(2, 128, device=DEVICE))
    torch.testing.assert_close(packed.mm(x), x @ weight.T, rtol=1e-5, atol=1e-5)
    # Rounding: within half a step of each value (and 127 times the scale's
    # float16 rounding, 2**-11 relative), and then exactly on the grid.
    dense = torch.randn(16, 128, device=DEVICE)
    rounded = round_to_q8_0(dense)
    step = dense.reshape(16, blocks, 32).abs().amax(-1, keepdim=True) / 127
    assert ((rounded - dense).abs().reshape(16, blocks, 32) <= step * 0.57).all()
    packed = pack_q8_gpu(rounded)
    assert packed is not None
    torch.testing.assert_close(
        dequantize_q8_reference(packed.data, packed.scales), rounded, rtol=0, atol=0
    )
    assert pack_q8_gpu(dense) is None and pack_q8_gpu(q4_1_weight(8, 64) * 1.001) is None


@pytest.mark.parametrize("shape", [(8, 64), (8, 40)])
def test_other_weights_stay_dense(shape: tuple[int, int]) -> None:
    assert pack_q4_gpu(torch.randn(*shape, device=DEVICE)) is None
    on_grid = q4_1_weight(8, 64)
    on_grid[3, 7] += 1e-3
    assert pack_q4_gpu(on_grid) is None


def test_rounding_to_q4_1_packs_and_stays_close() -> None:
    weight = torch.randn(16, 96, device=DEVICE) * 0.05
    rounded = round_to_q4_1(weight)
    step = (weight.reshape(16, 3, 32).amax(-1) - weight.reshape(16, 3, 32).amin(-1)) / 15
    assert ((rounded - weight).abs().reshape(16, 3, 32) <= step[..., None] * 0.51).all()
    packed = pack_q4_gpu(rounded)
    assert packed is not None
    torch.testing.assert_close(
        dequantize_q4_reference(packed.data, packed.scales), rounded, rtol=0, atol=0
    )


def test_layers_packed_while_loading_equal_their_rounded_dense_weights() -> None:
    from asyncstep.models.dummy import dummy_weights, get_shape
    from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear
    from asyncstep.models.llama import LlamaForCausalLM

    arch = get_shape("tiny-llama")
    with torch.device(DEVICE):
        model = LlamaForCausalLM(arch, torch.float32)
    names = model.expected_weight_names()
    weights = dict(round_decoder_weights(dummy_weights(arch, device=DEVICE, names=names)))
    with packing_on_load(model, tied=model.model.embed_tokens.weight) as counts:
        model.load_weights(weights.items())
    layers = arch.num_hidden_layers
    assert counts["q4"] == 4 * layers and counts["dense"] == 1  # the LM head: not rounded
    assert model.lm_head is not None and model.lm_head.packed is None
    layer = model.model.stage_layers()[1]
    prefix = "model.layers.1."
    dense = {
        layer.self_attn.qkv_proj: torch.cat(
            [weights[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"]
        ),
        layer.mlp.gate_up_proj: torch.cat(
            [weights[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")]
        ),
        layer.self_attn.o_proj: weights[f"{prefix}self_attn.o_proj.weight"],
        layer.mlp.down_proj: weights[f"{prefix}mlp.down_proj.weight"],
    }
    for module, weight in dense.items():
        assert isinstance(module, ColumnParallelLinear | RowParallelLinear)
        assert isinstance(module.packed, GpuQ4Weight)
        torch.testing.assert_close(module.weight, weight, rtol=0, atol=0)  # dense, beside
        calls: list[int] = []
        mm = module.packed.mm
        module.packed.mm = lambda x, mm=mm, calls=calls: calls.append(x.shape[0]) or mm(x)  # type: ignore[method-assign]
        for rows in (1, 3):  # one row: the Q4 copy; more: the dense weight
            x = torch.randn(rows, weight.shape[1], device=DEVICE)
            torch.testing.assert_close(module(x), x @ weight.T, rtol=1e-5, atol=1e-5)
        assert calls == [1]
    # The loaders are the layers' own again.
    assert not hasattr(layer.self_attn.o_proj.weight.weight_loader, "staging")


def test_an_lm_head_rounded_to_q8_0_packs_as_q8() -> None:
    from asyncstep.models.dummy import dummy_weights, get_shape
    from asyncstep.models.llama import LlamaForCausalLM

    arch = get_shape("tiny-llama")
    with torch.device(DEVICE):
        model = LlamaForCausalLM(arch, torch.float32)
    names = model.expected_weight_names()
    tensors = dummy_weights(arch, device=DEVICE, names=names)
    weights = dict(round_decoder_weights(tensors, lm_head=True))
    with packing_on_load(model, tied=model.model.embed_tokens.weight) as counts:
        model.load_weights(weights.items())
    assert counts["q4"] == 4 * arch.num_hidden_layers and counts["q8"] == 1
    assert counts["dense"] == 0
    head = model.lm_head
    assert head is not None and isinstance(head.packed, GpuQ8Weight)
    torch.testing.assert_close(head.weight, weights["lm_head.weight"], rtol=0, atol=0)
    x = torch.randn(1, arch.hidden_size, device=DEVICE)
    logits = head.compute_logits(x)
    torch.testing.assert_close(logits, x @ head.weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a whole engine on the GPU")
@pytest.mark.trio
async def test_a_4_bit_model_generates_what_its_dense_twin_does() -> None:
    import asyncstep
    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model

    base = {"model": "tiny-llama", "load_format": "dummy", "device": "cuda", "dtype": "float32"}
    quant = load_model(ModelConfig(**base, weight_packing="q4"))
    dense = load_model(ModelConfig(**base, weight_packing="none"))
    for module in dense.model.modules():
        if hasattr(module, "packed"):
            rounding = round_to_q8_0 if module is dense.model.lm_head else round_to_q4_1
            module.weight.data = rounding(module.weight.data)
    assert all(
        isinstance(m.packed, GpuQ4Weight)
        for m in quant.model.modules()
        if hasattr(m, "packed") and m is not quant.model.lm_head
    )
    assert isinstance(quant.model.lm_head.packed, GpuQ8Weight)
    params = asyncstep.SamplingParams(temperature=0, max_tokens=12, logprobs=1)
    prompts = [[5, 17, 301, 42], [7] * 40]
    outs = []
    for loaded in (quant, dense):
        async with asyncstep.open_engine(loaded, max_model_len=256) as engine:
            outs.append([await engine.generate(p, params) for p in prompts])
    for q, d in zip(*outs, strict=True):
        assert q.token_ids == d.token_ids


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU's packing")
def test_q4_rounding_on_the_cpu_packs_the_cpu_way() -> None:
    from asyncstep.config import ModelConfig
    from asyncstep.models.model_loader import load_model

    loaded = load_model(
        # (bfloat16 named: the CPU packs bf16 models only, and ``auto`` is
        # float32 on a CPU without bf16 dot products)
        ModelConfig(
            model="tiny-llama",
            load_format="dummy",
            device="cpu",
            dtype="bfloat16",
            weight_packing="q4",
        )
    )
    layer = loaded.model.model.stage_layers()[0]
    for module in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        # Packed by the CPU's own packing (whichever kind it uses), not the GPU's.
        assert module.packed is not None and not isinstance(module.packed, GpuQ4Weight)
    # On the CPU the LM head is not rounded to Q8_0's grid, so stays dense.
    assert loaded.model.lm_head is not None and loaded.model.lm_head.packed is None
