"""The one-row GEMV of dense 16-bit weights (``asyncstep.ops.triton.gemv``):
it equals the float64 product within one rounding to x's dtype, for tiles
that divide the shape and tiles that do not, under every launch it picks
for llama-8b's and llama-1b's shapes; bad arguments raise; the linear
layers take it only for a one-row 16-bit step on CUDA with the switch on
(elsewhere ``F.linear``, bit for bit), and the runner turns it on with the
fused decode.

On the CPU the kernel runs under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported); with
``ASYNCSTEP_TEST_DEVICE=cuda`` compiled, and a model layer's one-row step
through it.
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

from asyncstep.ops.select import select_ops  # noqa: E402
from asyncstep.ops.triton import TritonOps  # noqa: E402
from asyncstep.ops.triton.gemv import GemvLaunch, dense_gemv, gemv_launch  # noqa: E402
from asyncstep.ops.triton.paged_attention import TritonAttention  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but CUDA is unavailable", allow_module_level=True)

#: One rounding to the dtype (the interpreter truncates to bfloat16: a whole
#: ulp), plus float32 noise.
ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8 if DEVICE.type == "cuda" else 2.0**-7}


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    exact = x.double().reshape(1, -1) @ w.double().T
    assert out.dtype == x.dtype
    torch.testing.assert_close(
        out.double().reshape(exact.shape), exact, rtol=ROUNDING[x.dtype], atol=1e-3
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("n", "k", "launch"),
    [
        (32, 256, GemvLaunch(8, 64, 2)),  # every tile inside
        (30, 200, GemvLaunch(8, 64, 2)),  # partial tiles both ways
        (7, 1000, GemvLaunch(2, 256, 4)),
        (40, 96, None),  # its own launch: one 128-wide step, masked
    ],
)
def test_gemv_equals_the_product(
    dtype: torch.dtype, n: int, k: int, launch: GemvLaunch | None
) -> None:
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    x = torch.randn(1, 1, k, device=DEVICE).to(dtype)
    out = dense_gemv(x, w, launch)
    assert out.shape == (1, 1, n)
    check(out, x, w)


@pytest.mark.parametrize(
    ("n", "k"),
    [
        (6144, 4096),  # llama-8b: qkv, o, gate_up, down
        (4096, 4096),
        (28672, 4096),
        (4096, 14336),
        (3072, 2048),  # llama-1b
        (2048, 2048),
        (16384, 2048),
        (2048, 8192),
    ],
)
def test_each_picked_launch_computes_the_product(n: int, k: int) -> None:
    """The launch picked for a full shape, on a weight of a few of its tiles
    (the interpreter's time): the same tiling, loop and masks."""
    launch = gemv_launch(n, k)
    assert k % launch.block_k == 0 and n % launch.block_n == 0
    rows, cols = 3 * launch.block_n, 2 * launch.block_k
    w = torch.randn(rows, cols, device=DEVICE).bfloat16()
    x = torch.randn(1, cols, device=DEVICE).bfloat16()
    check(dense_gemv(x, w, launch), x, w)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k", "launch"), [(32, 256, GemvLaunch(8, 64, 2)), (30, 200, None)])
def test_the_bias_is_added_before_the_one_rounding(
    n: int, k: int, launch: GemvLaunch | None, bias_dtype: torch.dtype
) -> None:
    """``bias`` (gpt-oss's projections): the float64 ``x @ w.T + b`` within
    one rounding, in x's dtype; a bias that does not fit is a ValueError."""
    w = torch.randn(n, k, device=DEVICE).bfloat16()
    x = torch.randn(1, k, device=DEVICE).bfloat16()
    bias = (torch.randn(n, device=DEVICE) * 4).to(bias_dtype)
    out = dense_gemv(x, w, launch, bias=bias)
    assert out.dtype == torch.bfloat16 and out.shape == (1, n)
    exact = x.double() @ w.double().T + bias.double()
    torch.testing.assert_close(out.double(), exact, rtol=ROUNDING[x.dtype], atol=1e-3)
    with pytest.raises(ValueError, match="bias"):
        dense_gemv(x, w, launch, bias=bias[:-1])


@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.zeros(1, 64), torch.zeros(8, 64), "bfloat16 or float16"),
        (torch.zeros(1, 64).half(), torch.zeros(8, 64).bfloat16(), "of its dtype"),
        (torch.zeros(2, 64).half(), torch.zeros(8, 64).half(), "one row"),
        (torch.zeros(1, 32).half(), torch.zeros(8, 64).half(), "one row"),
        (torch.zeros(1, 64).half(), torch.zeros(64, 8).half().T, "unit stride"),
    ],
)
def test_bad_arguments_raise(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dense_gemv(x.to(DEVICE), w.to(DEVICE))


@pytest.mark.parametrize("rows", [1, 2])
def test_the_fused_decode_op_set_takes_it_for_one_row_16_bit_steps_on_cuda(rows: int) -> None:
    w = torch.randn(24, 64, device=DEVICE).bfloat16()
    bias = torch.randn(24, device=DEVICE).bfloat16()
    x = torch.randn(rows, 64, device=DEVICE).bfloat16()
    gemv_ops = TritonOps(TritonAttention(rotates=True), fused_decode=True)
    out = gemv_ops.linear(x, w, None, bias)
    if DEVICE.type == "cuda" and rows == 1:  # the bias in the GEMV's epilogue
        assert torch.equal(out, dense_gemv(x, w, bias=bias))
    else:  # F.linear, bit for bit
        assert torch.equal(out, F.linear(x, w, bias))
    plain = TritonOps(TritonAttention(rotates=True))
    assert torch.equal(plain.linear(x, w, None, bias), F.linear(x, w, bias))
    x32, w32 = x.float(), w.float()  # float32 keeps F.linear on CUDA too
    assert torch.equal(gemv_ops.linear(x32, w32, None), F.linear(x32, w32))


def test_the_choice_gives_it_with_the_fused_decode() -> None:
    """Chosen once, with the op set: the fused decode's op set runs it."""
    cuda = torch.device("cuda")
    on = select_ops(cuda, "triton", fused_kernels=True, fused_decode=True, batch_invariant=False)
    off = select_ops(cuda, "triton", fused_kernels=True, fused_decode=False, batch_invariant=False)
    assert isinstance(on, TritonOps) and on.fused_decode
    assert isinstance(off, TritonOps) and not off.fused_decode
