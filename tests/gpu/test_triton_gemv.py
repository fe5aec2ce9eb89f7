"""The one-row GEMV of dense 16-bit weights (``asyncstep.gpu.triton_gemv``):
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
from typing import Any

import pytest
import torch
import torch.nn.functional as F

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from asyncstep.gpu.triton_gemv import (  # noqa: E402
    GemvLaunch,
    dense_gemv,
    dense_gemv_fused,
    gemv_launch,
)
from asyncstep.models.layers.linear import packed_linear  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but CUDA is unavailable", allow_module_level=True)

#: One rounding to the dtype (the interpreter truncates to bfloat16: a whole
#: ulp), plus float32 noise.
ROUNDING = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8 if DEVICE.type == "cuda" else 2.0**-7}
#: A launch of small tiles: several programs and loop steps on small weights.
LAUNCH = GemvLaunch(8, 64, 2)


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
def test_linear_layers_take_it_for_one_row_16_bit_steps_on_cuda(rows: int) -> None:
    w = torch.randn(24, 64, device=DEVICE).bfloat16()
    bias = torch.randn(24, device=DEVICE).bfloat16()
    x = torch.randn(rows, 64, device=DEVICE).bfloat16()
    out = packed_linear(x, w, None, bias, dense_gemv=True)
    if DEVICE.type == "cuda" and rows == 1:
        torch.testing.assert_close(out, dense_gemv(x, w) + bias, rtol=0, atol=0)
    else:  # F.linear, bit for bit
        assert torch.equal(out, F.linear(x, w, bias))
    assert torch.equal(packed_linear(x, w, None, bias), F.linear(x, w, bias))
    x32, w32 = x.float(), w.float()  # float32 keeps F.linear on CUDA too
    assert torch.equal(packed_linear(x32, w32, None, dense_gemv=True), F.linear(x32, w32))


def test_the_runner_switches_it_with_the_fused_decode() -> None:
    from asyncstep.models.dummy import get_shape
    from asyncstep.models.llama import LlamaForCausalLM
    from asyncstep.runner.model_runner import _use_dense_gemv

    model = LlamaForCausalLM(get_shape("tiny-llama"), torch.float32)
    layer = model.model.stage_layers()[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj]
    _use_dense_gemv(model, True)
    assert all(linear.dense_gemv for linear in linears) and model.lm_head.dense_gemv
    _use_dense_gemv(model, False)
    assert not any(linear.dense_gemv for linear in linears) and not model.lm_head.dense_gemv


# -- the fused decode's prologues and epilogues ---------------------------------------


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return F.rms_norm(x.double(), (x.shape[-1],), weight.double(), eps)


def close(actual: torch.Tensor, expected: torch.Tensor, ulps: float = 2) -> None:
    tol = ulps * ROUNDING[actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("n", "k"), [(32, 256), (30, 200)])
def test_rms_norm_prologue(n: int, k: int) -> None:
    w = torch.randn(n, k, device=DEVICE).bfloat16()
    x = (torch.randn(1, k, device=DEVICE) * 3).bfloat16()
    norm = torch.randn(k, device=DEVICE).bfloat16()
    out, normed = dense_gemv_fused(x, w, rms_norm_weight=norm, eps=1e-5, launch=LAUNCH)
    assert out.shape == (1, n) and normed is None
    close(out, rms(x, norm) @ w.double().T, ulps=4)


@pytest.mark.parametrize(("n", "k"), [(64, 256), (40, 96)])
def test_residual_and_next_norm_then_the_normed_prologue(n: int, k: int) -> None:
    """o_proj's epilogue (residual add, the next norm's rows made ready),
    then gate_up's normed prologue with SiLU·mul of the weight's halves."""
    w = torch.randn(n, k, device=DEVICE).bfloat16() * 0.1
    x, residual = torch.randn(1, k, device=DEVICE).bfloat16(), torch.randn(1, n, device=DEVICE)
    residual = residual.bfloat16()
    next_weight = torch.randn(n, device=DEVICE).bfloat16()
    stream, normed = dense_gemv_fused(
        x, w, residual=residual, next_rms_norm_weight=next_weight, launch=LAUNCH
    )
    product = (x.double() @ w.double().T).to(torch.bfloat16)  # rounded, then added
    close(stream, product.double() + residual.double())
    assert normed is not None
    close(normed.xw, stream.double() * next_weight.double(), ulps=1)  # one rounding
    assert normed.sq_parts.shape == (1, -(-n // LAUNCH.block_n))
    torch.testing.assert_close(normed.sq_parts.sum(), stream.float().square().sum())
    gate_up = torch.randn(48, n, device=DEVICE).bfloat16()
    act, _ = dense_gemv_fused(
        normed.xw, gate_up, sq_parts=normed.sq_parts, eps=1e-5, silu_halves=True, launch=LAUNCH
    )
    gate, up = (rms(stream, next_weight) @ gate_up.double().T).chunk(2, -1)
    assert act.shape == (1, 24)
    close(act, F.silu(gate.bfloat16().double()) * up.bfloat16().double(), ulps=8)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rms_norm_weight": torch.ones(64), "sq_parts": torch.ones(1, 2)}, "one prologue"),
        ({"rms_norm_weight": torch.ones(32)}, "rms_norm_weight must be"),
        ({"sq_parts": torch.ones(2, 2)}, "sq_parts must be"),
        ({"residual": torch.ones(1, 7).bfloat16()}, "residual must be"),
        ({"residual": torch.ones(1, 16).half()}, "residual must be"),
        ({"silu_halves": True, "residual": torch.ones(1, 16).bfloat16()}, "silu_halves"),
        ({"next_rms_norm_weight": torch.ones(8)}, "next_rms_norm_weight must be"),
        ({"out_dtype": torch.float32}, "out_dtype"),
    ],
)
def test_bad_fused_arguments_raise(kwargs: dict[str, Any], match: str) -> None:
    w = torch.ones(16, 64, device=DEVICE).bfloat16()
    kwargs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        dense_gemv_fused(torch.ones(1, 64, device=DEVICE).bfloat16(), w, **kwargs)
