"""A MoE layer's routing and alignment in Triton and the experts' small-T
path (issue 41: ``asyncstep.ops.triton.moe_routing`` and the GEMV kernels
of ``asyncstep.ops.triton.fused_moe``): the alignment equals the torch ops
it replaces for random ids (T, k, E, block sizes, int32 / int64, strided);
the routing equals :func:`~asyncstep.ops.torch_moe.select_experts` (every
scoring, renormalised or not, ties to the lower id); the small-T path
against the float64 loop (silu, swigluoai with biases, float32 and bfloat16,
several T and k), the grouped GEMM's results within rounding, the same bits
for a token alone and in its batch; the batch-invariant op set never takes
it; the op sets route with the kernel; a tiny Qwen3-MoE's greedy tokens
through the Triton op set equal transformers'; the kernels compile for
sm_90. On the CPU under the Triton interpreter (``TRITON_INTERPRET=1``, set
before triton is imported), as ``test_fused_moe``.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton kernels need triton")

from sm90 import compile_for_sm90  # noqa: E402

from asyncstep.ops.torch_attention import TORCH_ATTENTION  # noqa: E402
from asyncstep.ops.torch_moe import select_experts  # noqa: E402
from asyncstep.ops.torch_ref import TorchOps  # noqa: E402
from asyncstep.ops.triton.fused_moe import fused_experts  # noqa: E402
from asyncstep.ops.triton.fused_moe_gemv import GEMV_TILE, INTERPRETER_GEMV_TILE  # noqa: E402
from asyncstep.ops.triton.invariant_ops import TritonInvariantOps  # noqa: E402
from asyncstep.ops.triton.moe_routing import (  # noqa: E402
    CHUNK,
    moe_align_block_size,
    topk_route,
    torch_align_block_size,
)
from asyncstep.ops.triton.ops import TritonOps  # noqa: E402
from tests.gpu.test_fused_moe import (  # noqa: E402
    DEVICE,
    H,
    _call,
    assert_near,
    make_experts,
    make_routing,
    reference,
)

#: Every T through the small-T path.
ALWAYS = 1 << 30
#: The reference op set (torch's routing).
TORCH_OPS = TorchOps()


# --------------------------------------------------------------------------
# the alignment


@pytest.mark.parametrize(
    ("t", "k", "e", "block_m"),
    [
        (1, 8, 128, 16),
        (3, 2, 5, 4),
        (17, 2, 8, 16),
        (100, 4, 32, 16),
        (70, 8, 128, 16),
        (5, 1, 3, 64),
    ],
)
def test_the_alignment_is_the_torch_ops_one(t: int, k: int, e: int, block_m: int) -> None:
    """Random ids (repeats within a token too): the same sorted pairs, block
    experts and padded total; 70 x 8 pairs span several scatter chunks."""
    gen = torch.Generator().manual_seed(t * 1000 + k * 100 + e)
    ids = torch.randint(0, e, (t, k), generator=gen, dtype=torch.int32).to(DEVICE)
    want = torch_align_block_size(ids, e, block_m)
    strided = torch.stack((ids.long(), ids.long()), dim=2)[:, :, 0]  # int64, stride 2
    for got in (moe_align_block_size(ids, e, block_m), moe_align_block_size(strided, e, block_m)):
        assert torch.equal(got.sorted_ids, want.sorted_ids)
        assert torch.equal(got.expert_ids, want.expert_ids)
        assert torch.equal(got.padded_pairs, want.padded_pairs)
        assert (got.num_pairs, got.block_m) == (want.num_pairs, want.block_m)


def test_one_expert_taking_every_pair_across_chunks() -> None:
    """3 * CHUNK pairs on expert 2 (its run spans the chunks, in p order)."""
    ids = torch.full((3 * CHUNK // 2, 2), 2, dtype=torch.int32).to(DEVICE)
    got, want = moe_align_block_size(ids, 4, 16), torch_align_block_size(ids, 4, 16)
    assert torch.equal(got.sorted_ids, want.sorted_ids)
    assert got.sorted_ids[: 3 * CHUNK].tolist() == list(range(3 * CHUNK))
    assert torch.equal(got.expert_ids, want.expert_ids)


# --------------------------------------------------------------------------
# the routing


@pytest.mark.parametrize(
    ("scoring", "renormalize"),
    [
        ("softmax", True),
        ("softmax", False),
        ("sigmoid", True),
        ("sigmoid", False),
        ("topk_softmax", False),
    ],
)
@pytest.mark.parametrize(("t", "e", "k"), [(1, 128, 8), (7, 5, 2), (9, 32, 4), (4, 60, 6)])
def test_the_routing_is_the_reference(
    scoring: str, renormalize: bool, t: int, e: int, k: int
) -> None:
    """float32 logits (no ties): the same ids in the same order, weights
    within float32 rounding (the sums' order differs); bfloat16 logits
    strided, the same as their float32 values."""
    gen = torch.Generator().manual_seed(t + e + k)
    logits = torch.randn(t, e, generator=gen).to(DEVICE)
    weights, ids = topk_route(logits, k, renormalize=renormalize, scoring_func=scoring)
    want_w, want_ids = select_experts(logits, k, renormalize=renormalize, scoring_func=scoring)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    distinct = (torch.randperm(2 * e, generator=gen)[:e].float() / 16 - 3).repeat(t, 1)
    wide = torch.stack((distinct, distinct), dim=2).to(torch.bfloat16).to(DEVICE)[:, :, 0]
    got16 = topk_route(wide, k, renormalize=renormalize, scoring_func=scoring)
    got32 = topk_route(wide.float(), k, renormalize=renormalize, scoring_func=scoring)
    assert torch.equal(got16[1], got32[1]) and torch.equal(got16[0], got32[0])


def test_ties_go_to_the_lower_expert_and_bad_arguments_are_value_errors() -> None:
    """Ties to the lower id; a NaN above every score (torch's topk), each id
    once among equal scores (a padding row's garbage routes in range)."""
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, 2.0]]).to(DEVICE)
    weights, ids = topk_route(logits, 4, renormalize=True)
    assert ids.tolist() == [[1, 3, 5, 2]]
    torch.testing.assert_close(float(weights.sum()), 1.0)
    with pytest.raises(ValueError, match="scoring"):
        topk_route(logits, 2, renormalize=False, scoring_func="tanh")
    with pytest.raises(ValueError, match="top_k"):
        topk_route(logits, 7, renormalize=False)
    rows = torch.tensor([[float("nan")] * 4, [float("-inf")] * 4, [1.0, float("nan"), 0.0, 2.0]])
    for scoring in ("softmax", "sigmoid", "topk_softmax"):
        ids = topk_route(rows.to(DEVICE), 3, renormalize=False, scoring_func=scoring)[1]
        assert ids.tolist()[0] == [0, 1, 2] and len(set(ids.tolist()[1])) == 3, scoring
    assert topk_route(rows.to(DEVICE), 2, renormalize=False, scoring_func="sigmoid")[1][
        2
    ].tolist() == [1, 3]
    empty = topk_route(logits[:0], 2, renormalize=False)
    assert empty[0].shape == (0, 2) and empty[1].shape == (0, 2)


def test_the_routing_kernel_counts_each_token_s_experts() -> None:
    """``counts``: each chosen expert plus one a token, added over calls (the
    integer atomics' sums: the ids' bincount); the reference op set counts
    alike by index_add_; counts that do not fit are ValueErrors."""
    gen = torch.Generator().manual_seed(91)
    counts = torch.full((32,), 5, dtype=torch.int64).to(DEVICE)
    want = counts.clone().cpu()
    for t in (7, 1):
        logits = torch.randn(t, 32, generator=gen).to(DEVICE)
        weights, ids = topk_route(logits, 4, renormalize=True, counts=counts)
        uncounted = topk_route(logits, 4, renormalize=True)
        assert torch.equal(weights, uncounted[0]) and torch.equal(ids, uncounted[1])
        want += torch.bincount(ids.reshape(-1).long().cpu(), minlength=32)
        assert torch.equal(counts.cpu(), want)
        ref = torch.zeros(32, dtype=torch.int64).to(DEVICE)
        TORCH_OPS.select_experts(logits, 4, renormalize=True, counts=ref)
        assert torch.equal(ref.cpu(), torch.bincount(ids.reshape(-1).long().cpu(), minlength=32))
    for bad in (counts.int(), counts[:31], torch.zeros(64, dtype=torch.int64).to(DEVICE)[::2]):
        with pytest.raises(ValueError, match="counts"):
            topk_route(logits, 4, renormalize=True, counts=bad)


def test_the_op_sets_route_with_the_kernel() -> None:
    logits = torch.randn(5, 8).to(DEVICE)
    want = topk_route(logits, 2, renormalize=True)
    for ops in (TritonOps(TORCH_ATTENTION), TritonInvariantOps(TORCH_ATTENTION)):
        got = ops.select_experts(logits, 2, renormalize=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), ops.name


# --------------------------------------------------------------------------
# the small-T path


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("t", [1, 2, 5])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_small_t_path_matches_the_float64_loop(
    dtype: torch.dtype, activation: str, t: int, k: int
) -> None:
    """swigluoai with both biases (gpt-oss), silu without; within the
    grouped GEMM's tolerance of the loop and of the grouped GEMM."""
    experts = make_experts(8, dtype, seed=t * 10 + k, biases=activation == "swigluoai")
    weights, ids = make_routing(t, 8, k, seed=t * 7 + k)
    x = torch.randn(t, H).to(dtype).to(DEVICE)
    kwargs = _call(experts, weights, ids, activation)
    small = fused_experts(x, **kwargs, gemv_max_pairs=ALWAYS)
    assert small.shape == (t, H) and small.dtype == dtype
    want = reference(x, experts, weights, ids, activation)
    assert_near(small, want, dtype)
    assert_near(fused_experts(x, **kwargs, gemv_max_pairs=0), want, dtype)


@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
def test_each_small_t_tile_gives_the_small_t_sums(activation: str) -> None:
    """GEMV_TILE (CUDA's: one column a program) and the interpreter's wider
    tile run the same kernels: the same products within float32 rounding
    (of the largest output: the tiles sum in other orders, and an output
    near zero is a cancellation of terms that large)."""
    experts = make_experts(4, torch.float32, seed=41, biases=activation == "swigluoai")
    weights, ids = make_routing(1, 4, 2, seed=42)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(43)).to(DEVICE)
    kwargs = _call(experts, weights, ids, activation)
    tiles = (GEMV_TILE, INTERPRETER_GEMV_TILE)
    narrow, wide = (fused_experts(x, **kwargs, gemv_max_pairs=ALWAYS, gemv_tile=t) for t in tiles)
    scale = float(wide.abs().max())
    torch.testing.assert_close(narrow, wide, rtol=1e-5, atol=1e-6 * scale)
    assert_near(narrow, reference(x, experts, weights, ids, activation), torch.float32)


def test_the_small_t_path_without_biases_for_swigluoai_and_silu_with() -> None:
    """Each bias optional on either activation."""
    for activation, biases in (("swigluoai", False), ("silu", True)):
        experts = make_experts(4, torch.float32, seed=31, biases=biases)
        weights, ids = make_routing(3, 4, 2, seed=32)
        x = torch.randn(3, H).to(DEVICE)
        got = fused_experts(x, **_call(experts, weights, ids, activation), gemv_max_pairs=ALWAYS)
        assert_near(got, reference(x, experts, weights, ids, activation), torch.float32)


def test_the_small_t_path_s_rows_are_the_same_bits_alone_and_in_the_batch() -> None:
    experts = make_experts(8, torch.bfloat16, seed=41, biases=True)
    weights, ids = make_routing(6, 8, 2, seed=42)
    x = torch.randn(6, H).to(torch.bfloat16).to(DEVICE)
    kwargs = _call(experts, weights, ids, "swigluoai")
    batch = fused_experts(x, **kwargs, gemv_max_pairs=ALWAYS)
    for t in (0, 4):
        one = _call(experts, weights[t : t + 1], ids[t : t + 1], "swigluoai")
        assert torch.equal(fused_experts(x[t : t + 1], **one, gemv_max_pairs=ALWAYS)[0], batch[t])


def test_the_path_is_chosen_by_pairs_and_the_invariant_op_set_never_takes_the_small_one() -> None:
    """T * k at the threshold: the small-T path; one past: the grouped GEMM
    (bits that differ from the small path's on these inputs); the invariant
    op set's bits are the grouped GEMM's at every T."""
    experts = make_experts(4, torch.float32, seed=51)
    weights, ids = make_routing(3, 4, 2, seed=52)
    x = torch.randn(3, H).to(DEVICE)
    kwargs = _call(experts, weights, ids, "silu")
    small = fused_experts(x, **kwargs, gemv_max_pairs=ALWAYS)
    grouped = fused_experts(x, **kwargs, gemv_max_pairs=0)
    assert not torch.equal(small, grouped)
    assert torch.equal(fused_experts(x, **kwargs, gemv_max_pairs=6), small)
    assert torch.equal(fused_experts(x, **kwargs, gemv_max_pairs=5), grouped)
    invariant, plain = TritonInvariantOps(TORCH_ATTENTION), TritonOps(TORCH_ATTENTION)
    assert invariant.gemv_max_pairs == 0 and plain.gemv_max_pairs >= 6
    w13, w2 = experts["w13"], experts["w2"]
    assert w13 is not None and w2 is not None
    assert torch.equal(invariant.fused_experts(x, w13, w2, weights, ids), grouped)
    assert torch.equal(plain.fused_experts(x, w13, w2, weights, ids), small)


def test_the_interleaved_layout_on_the_small_t_path() -> None:
    experts = make_experts(4, torch.float32, seed=61, biases=True)
    w13, b13 = experts["w13"], experts["w13_bias"]
    assert w13 is not None and b13 is not None
    inter = w13.shape[1] // 2
    interleaved = torch.stack((w13[:, :inter], w13[:, inter:]), dim=2).reshape(w13.shape)
    b_interleaved = torch.stack((b13[:, :inter], b13[:, inter:]), dim=2).reshape(b13.shape)
    weights, ids = make_routing(2, 4, 2, seed=62)
    x = torch.randn(2, H).to(DEVICE)
    kwargs = _call(experts, weights, ids, "swigluoai")
    plain = fused_experts(x, **kwargs, gemv_max_pairs=ALWAYS)
    kwargs.update(w13=interleaved, w13_bias=b_interleaved)
    got = fused_experts(x, **kwargs, interleaved_gate_up=True, gemv_max_pairs=ALWAYS)
    # Compiled for a GPU the two layouts' loads differ, and so may the
    # association of the sums (they parted in the last bits on an H100).
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# the engine


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU engine's model, interpreted")
def test_a_tiny_qwen3_moe_s_greedy_tokens_through_the_triton_op_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton op set's router and experts (the small-T path for decode
    rows, the grouped GEMM for prompts) in an engine of transformers' tiny
    Qwen3-MoE (float32, the reference's attention; the runner given this op
    set): transformers' tokens."""
    from asyncstep.runner import model_runner
    from tests.models.hf_parity import Parity, random_model
    from tests.models.test_moe import PARITY, tiny_config

    class Counting(TritonOps):
        """The Triton op set, counting the routings and each path's calls."""

        calls: ClassVar[dict[str, int]] = {"route": 0, "small": 0, "grouped": 0}

        def select_experts(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            self.calls["route"] += 1
            return super().select_experts(*args, **kwargs)

        def fused_experts(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            small = args[4].numel() <= self.gemv_max_pairs
            self.calls["small" if small else "grouped"] += 1
            return super().fused_experts(*args, **kwargs)

    path, expected = PARITY.save(random_model(tiny_config("qwen3_moe")), tmp_path)
    ops = Counting(TORCH_ATTENTION)
    ops.gemv_max_pairs = 8  # the decode steps' 6 pairs, not the prompts' 32
    monkeypatch.setattr(model_runner, "select_ops", lambda *args, **kwargs: ops)
    assert isinstance(PARITY, Parity)
    assert PARITY.serve(path, attention_backend="torch") == expected
    assert min(ops.calls.values()) > 0, ops.calls


# --------------------------------------------------------------------------
# the compiled kernels

#: Compiles the routing, alignment and small-T kernels for sm_90 with
#: triton's own ptxas, no GPU needed (the interpreter runs code the
#: compiler may refuse).
COMPILE = textwrap.dedent(
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from asyncstep.ops.triton import fused_moe_kernels as f, moe_routing_kernels as r

    GEMV = dict(HAS_BIAS=True, BLOCK_N=16, BLOCK_K=256)
    CASES = [
        (r.topk_route_kernel, dict(TOP_K=8, K_PAD=8, E_PAD=128, SCORING=0, RENORMALIZE=True,
                                   COUNT=True),
         {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32",
          "counts_ptr": "*i64"}),
        (r.align_count_kernel, dict(BLOCK_M=16, E_PAD=128, CHUNK=128, BLOCKS_STEP=64),
         {"ids_ptr": "*i32", "chunk_base_ptr": "*i32", "sorted_ids_ptr": "*i32",
          "expert_ids_ptr": "*i32", "padded_ptr": "*i64"}),
        (r.align_scatter_kernel, dict(E_PAD=128, CHUNK=128),
         {"ids_ptr": "*i32", "chunk_base_ptr": "*i32", "sorted_ids_ptr": "*i32"}),
        (f.gemv_gate_up_kernel, dict(ROW_STEP=1, ACTIVATION=1, **GEMV),
         {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "ids_ptr": "*i32",
          "out_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"}),
        (f.gemv_down_kernel, dict(TOP_K=4, **GEMV),
         {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "route_ptr": "*fp32",
          "ids_ptr": "*i32", "out_ptr": "*bf16"}),
    ]
    for fn, consts, types in CASES:
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        out = compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                      options={"num_warps": 4, "num_stages": 3})
        print(fn.__name__, len(out.asm["cubin"]) > 0)
    """
)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="compiled by the tests above")
def test_the_kernels_compile_for_sm90(tmp_path: Path) -> None:
    words = compile_for_sm90(COMPILE, tmp_path)
    names = ["topk_route_kernel", "align_count_kernel", "align_scatter_kernel"]
    names += ["gemv_gate_up_kernel", "gemv_down_kernel"]
    assert words == [w for name in names for w in (name, "True")]
