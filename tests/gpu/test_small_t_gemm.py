"""The few-row matmul of dense 16-bit weights (``asyncstep.ops.triton.small_t_gemm``):
it equals the float64 product within one rounding to x's dtype, for 1 to
32 rows, tiles that divide the shape and tiles that do not, with and
without a bias; a row's outputs are the same alone and among others of
the same batch size; bad arguments raise in one line.

On the CPU the kernel runs under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported); with
``ASYNCSTEP_TEST_DEVICE=cuda`` compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from asyncstep.ops.triton.small_t_gemm import (  # noqa: E402
    SmallTLaunch,
    small_t_gemm,
    small_t_launch,
)

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but CUDA is unavailable", allow_module_level=True)

#: One rounding to the dtype (the interpreter truncates to bfloat16: a whole
#: ulp), plus float32 noise.
ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8 if DEVICE.type == "cuda" else 2.0**-7}


def check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T
    if bias is not None:
        exact += bias.double()
    assert out.dtype == x.dtype and out.shape == exact.shape
    torch.testing.assert_close(out.double(), exact, rtol=ROUNDING[x.dtype], atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("t", "n", "k", "launch"),
    [
        (32, 64, 256, SmallTLaunch(16, 64, 4, 2)),  # every tile inside
        (5, 30, 200, SmallTLaunch(16, 64, 4, 2)),  # partial tiles every way
        (17, 48, 1000, SmallTLaunch(32, 128, 4, 3)),
        (2, 40, 96, None),  # its own launch: one 128-wide step, masked
        (1, 16, 64, None),
    ],
)
@pytest.mark.parametrize("biased", [False, True])
def test_it_equals_the_product(
    dtype: torch.dtype, t: int, n: int, k: int, launch: SmallTLaunch | None, biased: bool
) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + n + k)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE) if biased else None
    check(small_t_gemm(x, w, bias, launch), x, w, bias)


def test_a_row_s_outputs_do_not_depend_on_the_others_of_its_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 320, generator=gen).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(12, 320, generator=gen).to(torch.bfloat16).to(DEVICE)
    other = x.clone()
    other[1:] = torch.randn(11, 320, generator=gen).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(small_t_gemm(x, w)[0], small_t_gemm(other, w)[0])


def test_the_launch_fits_the_weight() -> None:
    assert small_t_launch(2048, 64).block_k == 64
    assert small_t_launch(4096, 14336).block_k == 256


@pytest.mark.parametrize(
    ("x", "w", "match"),
    [
        (torch.zeros(2, 8), torch.zeros(4, 8), "bfloat16 or float16"),
        (
            torch.zeros(33, 8, dtype=torch.bfloat16),
            torch.zeros(4, 8, dtype=torch.bfloat16),
            "at most 32",
        ),
        (
            torch.zeros(2, 8, dtype=torch.bfloat16),
            torch.zeros(4, 9, dtype=torch.bfloat16),
            "rows of 9",
        ),
        (
            torch.zeros(2, 8, dtype=torch.bfloat16),
            torch.zeros(8, 4, dtype=torch.bfloat16).T,
            "unit stride",
        ),
    ],
)
def test_bad_arguments_raise(x: torch.Tensor, w: torch.Tensor, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        small_t_gemm(x.to(DEVICE), w.to(DEVICE))
