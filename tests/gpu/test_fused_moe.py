"""The fused mixture-of-experts kernels (issue 41,
``asyncstep.ops.triton.fused_moe``) against a float64 loop over tokens and
their experts: float32 and bfloat16, T in 1, 3, 17, E in 4, 8, k in 1, 2,
an expert no token picks, "silu" and gpt-oss's "swigluoai" with biases;
an expert with two blocks of pairs (float16); the pairs' alignment; the
interleaved gate/up layout; any strides; a token's rows the same bits alone
and among 17 (the grouped GEMM at every T: ``gemv_max_pairs=0``, as the
batch-invariant op set runs it; the small-T path's own tests are
``test_moe_routing``'s); transformers' gpt-oss experts; the op sets; arguments that
do not fit. On the CPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported), which multiplies
bfloat16 tiles as float32 copies (exact products) and rounds float32 ->
bfloat16 by truncation, and a fresh process compiles them for sm_90 (no
GPU needed); ``ASYNCSTEP_TEST_DEVICE=cuda`` compiles and runs them.

Tolerances, against the float64 loop on the same (rounded) inputs, as
``|out - ref| <= atol * max|ref| + rtol * |ref|``: float32 2e-6 / 2e-6
(float32 sums over H and I); bfloat16 1e-2 / 1e-2 (the activation rounded
to bfloat16 before w2, the output rounded once).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels need triton")

from sm90 import compile_for_sm90  # noqa: E402

from asyncstep.ops.torch_attention import TORCH_ATTENTION  # noqa: E402
from asyncstep.ops.triton.fused_moe import (  # noqa: E402
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    TILE,
    fused_experts,
    gate_up_from_interleaved,
    moe_align_block_size,
)
from asyncstep.ops.triton.invariant_ops import TritonInvariantOps  # noqa: E402
from asyncstep.ops.triton.ops import TritonOps  # noqa: E402

DEVICE = torch.device(TEST_DEVICE)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("ASYNCSTEP_TEST_DEVICE=cuda but no CUDA device", allow_module_level=True)

#: H spans two BLOCK_K steps of the gate/up GEMM and a tail, and two column
#: tiles of the down GEMM; INTER (I) is one partial column tile and one K step.
H, INTER = TILE.block_k + 17, 24
TOLERANCE = {torch.float32: (2e-6, 2e-6), torch.bfloat16: (1e-2, 1e-2)}  # float16: bfloat16's


def make_experts(
    e: int, dtype: torch.dtype, seed: int, biases: bool = False
) -> dict[str, torch.Tensor | None]:
    """Random experts whose gate/up values reach past swigluoai's limit."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * INTER, H, generator=gen) * 0.5
    w2 = torch.randn(e, H, INTER, generator=gen) * 0.2
    b13 = torch.randn(e, 2 * INTER, generator=gen) if biases else None
    b2 = torch.randn(e, H, generator=gen) if biases else None
    return {
        "w13": w13.to(dtype).to(DEVICE),
        "w2": w2.to(dtype).to(DEVICE),
        "w13_bias": None if b13 is None else b13.to(dtype).to(DEVICE),
        "w2_bias": None if b2 is None else b2.to(dtype).to(DEVICE),
    }


def make_routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_weights (float32, each row's softmax) and topk_ids (int32,
    distinct per token), never the last expert (an expert with no tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(t)])
    weights = torch.randn(t, k, generator=gen).softmax(dim=-1)
    return weights.to(DEVICE), ids.to(torch.int32).to(DEVICE)


def reference(
    x: torch.Tensor,
    experts: dict[str, torch.Tensor | None],
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
) -> torch.Tensor:
    """The float64 loop over tokens and their experts."""
    w13, w2, b13, b2 = (experts[n] for n in ("w13", "w2", "w13_bias", "w2_bias"))
    assert w13 is not None and w2 is not None
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double().cpu() @ x[t].double().cpu()
            if b13 is not None:
                gate_up += b13[e].double().cpu()
            gate, up = gate_up[:INTER], gate_up[INTER:]
            if activation == "silu":
                act = torch.nn.functional.silu(gate) * up
            else:
                gate = gate.clamp(max=SWIGLU_LIMIT)
                up = up.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT)
                act = (up + 1) * gate * torch.sigmoid(gate * SWIGLU_ALPHA)
            y = w2[e].double().cpu() @ act
            if b2 is not None:
                y += b2[e].double().cpu()
            out[t] += float(weights[t, j]) * y
    return out


def assert_near(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCE[dtype]
    err = (out.double().cpu() - ref).abs()
    bound = atol * ref.abs().max() + rtol * ref.abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}"


# --------------------------------------------------------------------------
# against the reference


@pytest.mark.parametrize("e", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_experts_match_the_float64_loop(
    dtype: torch.dtype, activation: str, t: int, k: int, e: int
) -> None:
    """swigluoai with both biases (gpt-oss), silu without."""
    experts = make_experts(e, dtype, seed=t * 100 + k * 10 + e, biases=activation == "swigluoai")
    weights, ids = make_routing(t, e, k, seed=t + k + e)
    x = torch.randn(t, H).to(dtype).to(DEVICE)
    out = fused_experts(x, **_call(experts, weights, ids, activation))
    assert out.shape == (t, H) and out.dtype == dtype
    assert_near(out, reference(x, experts, weights, ids, activation), dtype)


def test_swigluoai_is_transformers_gpt_oss_experts() -> None:
    """gpt-oss's experts as transformers computes them (gate and up
    interleaved in ``gate_up_proj [E, H, 2I]``), through the loader's
    conversion to gate rows then up rows."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=4, num_experts_per_tok=2
    )
    config._experts_implementation = "eager"
    hf = GptOssExperts(config)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.5)
    weights, ids = make_routing(6, 4, 2, seed=17)
    x = torch.randn(6, H)
    with torch.no_grad():
        want = hf(x, ids.cpu().long(), weights.cpu())
    w13, b13 = gate_up_from_interleaved(
        hf.gate_up_proj.detach().transpose(1, 2), hf.gate_up_proj_bias.detach()
    )
    w2 = hf.down_proj.detach().transpose(1, 2).contiguous()
    got = fused_experts(
        x.to(DEVICE),
        w13.to(DEVICE),
        w2.to(DEVICE),
        weights,
        ids,
        "swigluoai",
        b13.to(DEVICE) if b13 is not None else None,
        hf.down_proj_bias.detach().to(DEVICE),
    )
    torch.testing.assert_close(got.cpu(), want, atol=1e-4 * float(want.abs().max()), rtol=1e-4)


def _call(
    experts: dict[str, torch.Tensor | None],
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: str,
) -> dict[str, Any]:
    """fused_experts' keyword arguments but hidden."""
    return {**experts, "topk_weights": weights, "topk_ids": ids, "activation": activation}


def test_the_pairs_are_listed_by_expert_in_padded_runs() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [2, 0]], dtype=torch.int32).to(DEVICE)
    block = 4
    align = moe_align_block_size(ids, 5, block)
    pairs, experts = align.sorted_ids.cpu(), align.expert_ids.cpu()
    # expert 0: pairs 1, 4, 7; expert 2: 0, 2, 5, 6; expert 3: 3; 1 and 4 none
    assert pairs[:12].tolist() == [1, 4, 7, 8, 0, 2, 5, 6, 3, 8, 8, 8]
    assert experts.tolist()[:3] == [0, 2, 3] and set(experts.tolist()[3:]) <= {-1}
    assert int(align.padded_pairs) == 12 and bool((pairs[12:] == 8).all())
    # the grid's bound: every block of any routing of 8 pairs over 5 experts
    assert experts.numel() * block >= 8 + 4 * (block - 1)


def test_the_interleaved_gate_up_layout_is_the_same_product() -> None:
    experts = make_experts(4, torch.float32, seed=5, biases=True)
    w13, b13 = experts["w13"], experts["w13_bias"]
    assert w13 is not None and b13 is not None
    interleaved = torch.stack((w13[:, :INTER], w13[:, INTER:]), dim=2).reshape(4, 2 * INTER, H)
    b_interleaved = torch.stack((b13[:, :INTER], b13[:, INTER:]), dim=2).reshape(4, 2 * INTER)
    back, b_back = gate_up_from_interleaved(interleaved, b_interleaved)
    assert torch.equal(back, w13) and b_back is not None and torch.equal(b_back, b13)
    weights, ids = make_routing(5, 4, 2, seed=9)
    x = torch.randn(5, H).to(DEVICE)
    kwargs = _call(experts, weights, ids, "swigluoai")
    plain = fused_experts(x, **kwargs)
    kwargs.update(w13=interleaved, w13_bias=b_interleaved)
    assert torch.equal(fused_experts(x, **kwargs, interleaved_gate_up=True), plain)


def test_an_expert_with_more_pairs_than_a_block_and_float16() -> None:
    """Every token on experts 1 and 2 (17 pairs each: two blocks), 0 and 3
    idle; float16 (the dot's other 16-bit input)."""
    experts = make_experts(4, torch.float16, seed=21)
    t = 17
    ids = torch.tensor([[1, 2] if i % 2 else [2, 1] for i in range(t)], dtype=torch.int32)
    weights = torch.rand(t, 2).softmax(dim=-1).to(DEVICE)
    x = torch.randn(t, H).to(torch.float16).to(DEVICE)
    out = fused_experts(x, **_call(experts, weights, ids.to(DEVICE), "silu"))
    assert_near(out, reference(x, experts, weights, ids, "silu"), torch.bfloat16)


def test_any_strides_give_the_same_bits() -> None:
    experts = make_experts(4, torch.float32, seed=22, biases=True)
    weights, ids = make_routing(5, 4, 2, seed=23)
    wide = torch.randn(5, 2 * H).to(DEVICE)
    kwargs = _call(experts, weights, ids, "swigluoai")
    want = fused_experts(wide[:, :H].contiguous(), **kwargs)
    w13, w2 = experts["w13"], experts["w2"]
    assert w13 is not None and w2 is not None
    kwargs["w13"] = w13.transpose(1, 2).contiguous().transpose(1, 2)  # K-major rows
    kwargs["w2"] = w2.transpose(1, 2).contiguous().transpose(1, 2)
    ids_strided = torch.stack((ids, ids), dim=2)[:, :, 0]
    kwargs["topk_ids"] = ids_strided
    assert torch.equal(fused_experts(wide[:, :H], **kwargs), want)


# --------------------------------------------------------------------------
# batch invariance


@pytest.mark.usefixtures("row_wise_interpreted_dot")  # OpenBLAS's AVX2 sgemm: see conftest.py
@pytest.mark.parametrize(
    ("dtype", "activation"), [(torch.float32, "silu"), (torch.bfloat16, "swigluoai")]
)
def test_a_tokens_rows_are_the_same_bits_alone_and_among_17(
    dtype: torch.dtype, activation: str
) -> None:
    experts = make_experts(8, dtype, seed=11, biases=activation == "swigluoai")
    weights, ids = make_routing(17, 8, 2, seed=12)
    x = torch.randn(17, H).to(dtype).to(DEVICE)
    batch = fused_experts(x, **_call(experts, weights, ids, activation), gemv_max_pairs=0)
    for t, (lo, hi) in ((5, (5, 6)), (0, (0, 1)), (16, (14, 17))):
        part = _call(experts, weights[lo:hi], ids[lo:hi], activation)
        assert torch.equal(fused_experts(x[lo:hi], **part, gemv_max_pairs=0)[t - lo], batch[t]), t


# --------------------------------------------------------------------------
# the op sets, the arguments


def test_the_triton_op_sets_take_the_kernels() -> None:
    experts = make_experts(4, torch.float32, seed=13)
    weights, ids = make_routing(3, 4, 2, seed=14)
    x = torch.randn(3, H).to(DEVICE)
    w13, w2 = experts["w13"], experts["w2"]
    for ops in (TritonOps(TORCH_ATTENTION), TritonInvariantOps(TORCH_ATTENTION)):
        want = fused_experts(x, w13, w2, weights, ids, gemv_max_pairs=ops.gemv_max_pairs)  # type: ignore[arg-type]
        got = ops.fused_experts(x, w13, w2, weights, ids, "silu")  # type: ignore[arg-type]
        assert torch.equal(got, want), ops.name


def test_arguments_that_do_not_fit_are_value_errors() -> None:
    experts = make_experts(4, torch.float32, seed=15)
    weights, ids = make_routing(3, 4, 2, seed=16)
    x = torch.randn(3, H).to(DEVICE)
    kwargs = _call(experts, weights, ids, "silu")
    with pytest.raises(ValueError, match="activation"):
        fused_experts(x, **{**kwargs, "activation": "gelu"})
    with pytest.raises(ValueError, match="hidden size"):
        fused_experts(x[:, :-1], **kwargs)
    with pytest.raises(ValueError, match="dtype"):
        fused_experts(x.double(), **kwargs)
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        fused_experts(x, **{**kwargs, "topk_ids": ids[:2]})
    with pytest.raises(ValueError, match="w2_bias"):
        fused_experts(x, **{**kwargs, "w2_bias": torch.zeros(4, H + 1)})
    empty = fused_experts(x[:0], **{**kwargs, "topk_weights": weights[:0], "topk_ids": ids[:0]})
    assert empty.shape == (0, H)


# --------------------------------------------------------------------------
# the compiled kernels

#: Compiles the kernels for sm_90 in bfloat16 (swigluoai and both biases:
#: the most code) with triton's own ptxas, no GPU needed; prints "mma" per
#: GEMM whose PTX multiplies on the tensor cores.
COMPILE = textwrap.dedent(
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from asyncstep.ops.triton import fused_moe_kernels as k

    TILE = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    DOT = dict(DOT_PRECISION="tf32", UPCAST=False)
    CASES = [
        (k.gate_up_kernel, dict(ROW_STEP=1, HAS_BIAS=True, ACTIVATION=1, **TILE, **DOT),
         {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
          "alpha": "fp32", "limit": "fp32"}),
        (k.down_kernel, dict(HAS_BIAS=True, **TILE, **DOT),
         {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "route_ptr": "*fp32",
          "out_ptr": "*fp32"}),
        (k.combine_kernel, dict(TOP_K=4, BLOCK_H=256), {"pair_ptr": "*fp32", "out_ptr": "*bf16"}),
    ]
    for fn, consts, types in CASES:
        types.update(sorted_ids_ptr="*i32", expert_ids_ptr="*i32")
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        out = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                      options={"num_warps": 4, "num_stages": 3})
        print(fn.__name__, len(out.asm["cubin"]) > 0, "mma" in out.asm["ptx"])
    """
)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="compiled by the tests above")
def test_the_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The interpreter runs what the compiler may refuse: compile the three
    kernels for Hopper (a fresh process without ``TRITON_INTERPRET``)."""
    words = compile_for_sm90(COMPILE, tmp_path)
    assert words == [
        *("gate_up_kernel", "True", "True"),
        *("down_kernel", "True", "True"),
        *("combine_kernel", "True", "False"),
    ]
