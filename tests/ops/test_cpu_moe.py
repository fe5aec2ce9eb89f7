"""The CPU library's grouped float32 experts (``cpu_moe.c``): the
reference's contract (:func:`~asyncstep.ops.torch_moe.fused_experts`: a
few ulps of float32 from it), in every build this machine compiles
(AVX-512, AVX2, plain C, with the library's flags; the whole library built
for AVX2 runs the AVX2 build); a row's result the same
bits alone and among other rows (issue 40), on 1 and 2 threads; the CPU op
set takes it for float32 experts (silu or swigluoai, biased or not) and the
reference for the others; MXFP4 weights kept packed give the dense call's
bits on the dequantized weights (every build, 1 and 2 threads, a row alone
and in batches); bad inputs refused in one line; a float32 Qwen3-MoE
through it greedy equals transformers' token for token."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.cpu_features import cpu_flags
from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.dense_f32 import dense_f32_matmul
from asyncstep.ops.cpu.f32_stack import CpuF32Stack
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.moe import CpuMoeExperts, moe_experts, moe_router
from asyncstep.ops.cpu.ops import CpuOps
from asyncstep.ops.mxfp4 import Mxfp4Weight
from asyncstep.ops.torch_moe import fused_experts, select_experts

EXPERTS = moe_experts()
pytestmark = pytest.mark.skipif(EXPERTS is None, reason="no C compiler: the library is off")

#: Each build: its target flags, the CPU flags it needs, its vector's lanes.
BUILDS: dict[str, tuple[tuple[str, ...], set[str], int]] = {
    "AVX-512": (("-march=native",), {"avx512f", "avx512vl"}, 8),
    "AVX2": (("-mavx2", "-mfma", "-mf16c"), {"avx2", "fma"}, 8),
    "plain C": ((), set(), 8),
}


def build(isa: str, tmp_path: Path) -> CpuMoeExperts:
    """cpu_moe.c alone, built for ``isa`` with the library's flags (skipped
    where this CPU lacks it)."""
    flags, needs, lanes = BUILDS[isa]
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))}: the {isa} build is not run")
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = Path(asyncstep.__file__).parent / "ops/cpu/cpu_moe.c"
    target = tmp_path / f"cpu_moe_{isa.replace(' ', '_')}.so"
    for openmp in (["-fopenmp"], []):  # threads where the compiler has OpenMP
        done = subprocess.run(
            [compiler, *library.BASE_FLAGS, *flags, *openmp, str(source), "-o", str(target)],
            capture_output=True,
        )
        if done.returncode == 0:
            break
    done.check_returncode()
    built = CpuMoeExperts(ctypes.CDLL(str(target)))
    assert built.lanes == lanes
    return built


def weights(experts: int, size: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(experts, 2 * inter, size) * 0.1, torch.randn(experts, size, inter) * 0.1


def route(tokens: int, experts: int, top_k: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Random rows and a softmax top-k routing, renormalised."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=generator)
    logits = torch.randn(tokens, experts, generator=generator)
    topk_weights, topk_ids = torch.topk(logits.softmax(-1), top_k)
    return x, topk_weights / topk_weights.sum(-1, keepdim=True), topk_ids.int()


def within_reference(got: torch.Tensor, *args: Any) -> bool:
    """float32 sums a few ulps of their magnitude from the reference's."""
    expected = fused_experts(*args)
    return bool(((got - expected).abs() <= 1e-5 * expected.abs().max() + 1e-7).all())


@pytest.mark.parametrize("isa", ["library", *BUILDS])
def test_every_build_computes_the_reference(isa: str, tmp_path: Path) -> None:
    """1 to 40 rows (an expert's rows: one row of W at a time up to 8, then
    the tiles), 8 experts of top 3 (experts with none): the reference's
    sums to float32's precision."""
    experts = EXPERTS if isa == "library" else build(isa, tmp_path)
    assert experts is not None
    w13, w2 = weights(8, 64, 48)
    for tokens in (1, 2, 5, 13, 40):
        x, topk_weights, topk_ids = route(tokens, 8, 3, seed=tokens)
        got = experts(x, w13, w2, topk_weights, topk_ids)
        assert got.dtype == torch.float32 and got.shape == (tokens, 64)
        assert within_reference(got, x, w13, w2, topk_weights, topk_ids), tokens


@pytest.mark.parametrize("isa", ["library", *BUILDS])
def test_a_row_s_result_does_not_depend_on_its_batch(isa: str, tmp_path: Path) -> None:
    """Every row of 120 (16 experts of top 4: an expert gets 1 to ~40 rows,
    across every tile shape), computed alone and in batches of 2, 7, 33 and
    120 rows from several offsets: the same bits, on 1 and 2 threads."""
    experts = EXPERTS if isa == "library" else build(isa, tmp_path)
    assert experts is not None
    w13, w2 = weights(16, 64, 80)
    x, topk_weights, topk_ids = route(120, 16, 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat(
            [experts(x[r : r + 1], w13, w2, topk_weights[r : r + 1], topk_ids[r : r + 1])
             for r in range(120)]
        )  # fmt: skip
        for count in (1, 2):
            torch.set_num_threads(count)
            for batch in (2, 7, 33, 120):
                for start in sorted({0, 5, 120 - batch}):
                    rows = slice(start, start + batch)
                    got = experts(x[rows], w13, w2, topk_weights[rows], topk_ids[rows])
                    assert torch.equal(got, alone[rows]), (count, batch, start)
    finally:
        torch.set_num_threads(threads)
    assert within_reference(alone, x, w13, w2, topk_weights, topk_ids)


def test_the_avx512_and_avx2_builds_give_the_same_bits(tmp_path: Path) -> None:
    """The SIMD builds differ in their tiles only (8 lanes, one K order,
    one tree): 1 to 40 rows, dense and MXFP4 weights, the same bits."""
    wide, narrow = build("AVX-512", tmp_path), build("AVX2", tmp_path)
    w13, w2 = weights(8, 64, 48)
    p13, p2 = mxfp4_weights(8, 64, 32)
    for tokens in (1, 5, 13, 40):
        x, topk_weights, topk_ids = route(tokens, 8, 3, seed=tokens)
        dense = (
            wide(x, w13, w2, topk_weights, topk_ids),
            narrow(x, w13, w2, topk_weights, topk_ids),
        )
        packed = (
            wide(x, p13, p2, topk_weights, topk_ids),
            narrow(x, p13, p2, topk_weights, topk_ids),
        )
        assert torch.equal(*dense) and torch.equal(*packed), tokens


def test_the_op_set_takes_float32_experts_and_the_reference_the_others() -> None:
    """``CpuOps.fused_experts``: float32 experts through the library (its
    bits, a strided row of hidden too; swigluoai and biases too: the
    reference's sums to float32's precision; MXFP4 weights too; bfloat16
    weights and rows: the float32 call's bits on them widened, rounded
    once); a width not whole vectors, the reference's grouped matmul over
    the op set's float32 matmul (its bits)."""
    kernels = load_cpu_kernels()
    assert kernels is not None and EXPERTS is not None
    ops = CpuOps(kernels.layer_ops)
    w13, w2 = weights(8, 64, 48)
    x, topk_weights, topk_ids = route(9, 8, 2)
    strided = torch.randn(9, 80)[:, :64]
    strided.copy_(x)
    got = ops.fused_experts(strided, w13, w2, topk_weights, topk_ids)
    assert torch.equal(got, EXPERTS(x, w13, w2, topk_weights, topk_ids))
    bias13, bias2 = torch.randn(8, 96), torch.randn(8, 64)
    gpt_oss: list[tuple[Any, ...]] = [
        (x, w13, w2, topk_weights, topk_ids, "swigluoai"),
        (x, w13, w2, topk_weights, topk_ids, "silu", bias13, bias2),
        (x, w13 * 30, w2, topk_weights, topk_ids, "swigluoai", bias13, bias2),  # clamped
    ]
    for args in gpt_oss:
        got = ops.fused_experts(*args)
        assert torch.equal(got, EXPERTS(*args))
        assert within_reference(got, *args)
    float32 = dense_f32_matmul()
    assert float32 is not None
    narrow = (x[:, :60], w13[:, :, :60].contiguous(), w2[:, :60].contiguous())
    got = ops.fused_experts(*narrow, topk_weights, topk_ids)
    assert torch.equal(got, fused_experts(*narrow, topk_weights, topk_ids, matmul=float32))
    assert within_reference(got, *narrow, topk_weights, topk_ids)
    half = ops.fused_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), topk_weights, topk_ids)
    widened = (x.bfloat16().float(), w13.bfloat16().float(), w2.bfloat16().float())
    assert half.dtype == torch.bfloat16  # the library's float32 sums, rounded once
    assert torch.equal(half, EXPERTS(*widened, topk_weights, topk_ids).bfloat16())
    p13, p2 = mxfp4_weights(8, 64, 32)  # MXFP4: the library's; bfloat16 rows: dequantized
    assert torch.equal(
        ops.fused_experts(x, p13, p2, topk_weights, topk_ids, "swigluoai"),
        EXPERTS(x, p13.dequantize(), p2.dequantize(), topk_weights, topk_ids, "swigluoai"),
    )
    dense = (p13.dequantize().bfloat16(), p2.dequantize().bfloat16())
    assert torch.equal(
        ops.fused_experts(x.bfloat16(), p13, p2, topk_weights, topk_ids),
        ops.fused_experts(x.bfloat16(), *dense, topk_weights, topk_ids),
    )


def test_bad_inputs_are_refused_in_one_line() -> None:
    assert EXPERTS is not None
    w13, w2 = weights(4, 64, 32)
    x, topk_weights, topk_ids = route(3, 4, 2)
    refused = "take float32 or bfloat16 rows, contiguous float32 or bfloat16 or MXFP4"
    with pytest.raises(ValueError, match=refused):
        EXPERTS(x.half(), w13, w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match=refused):  # one weight bfloat16, the other not
        EXPERTS(x, w13.bfloat16(), w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match=refused):
        EXPERTS(x, w13.transpose(1, 2), w2, topk_weights, topk_ids)
    with pytest.raises(ValueError, match=refused):
        EXPERTS(x, w13, w2, topk_weights, topk_ids, "gelu")
    with pytest.raises(
        ValueError, match=r"w2 bias \(4, 32\) does not match the experts' \(4, 64\)"
    ):
        EXPERTS(x, w13, w2, topk_weights, topk_ids, "silu", None, torch.zeros(4, 32))
    with pytest.raises(ValueError, match=r"expert weights \(4, 64, 64\), \(4, 32, 32\) do not"):
        EXPERTS(x, w13, w2[:, :32].contiguous(), topk_weights, topk_ids)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        EXPERTS(x, w13, w2, topk_weights, topk_ids + 3)
    empty = EXPERTS(x[:0], w13, w2, topk_weights[:0], topk_ids[:0])
    assert empty.shape == (0, 64)


def test_the_library_built_for_avx2_runs_the_avx2_experts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, avx2_kernels_cache: Path
) -> None:
    """``ASYNCSTEP_CPU_KERNELS_ISA=avx2``: the whole library's experts are
    the AVX2 build's (8 lanes), the same bits as cpu_moe.c built alone."""
    if {"avx2", "fma", "f16c"} - cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    monkeypatch.setenv(library.CACHE_ENV, str(avx2_kernels_cache))
    monkeypatch.setenv(library.ISA_ENV, "avx2")
    load_cpu_kernels.cache_clear()
    try:
        kernels = load_cpu_kernels()
    finally:
        load_cpu_kernels.cache_clear()
    assert kernels is not None
    experts = CpuMoeExperts(kernels.library)
    assert experts.lanes == 8
    w13, w2 = weights(8, 64, 48)
    x, topk_weights, topk_ids = route(20, 8, 2)
    got = experts(x, w13, w2, topk_weights, topk_ids)
    assert torch.equal(got, build("AVX2", tmp_path)(x, w13, w2, topk_weights, topk_ids))
    assert within_reference(got, x, w13, w2, topk_weights, topk_ids)


def tiny_qwen3_moe() -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        initializer_range=0.2,  # logits far from ties
        tie_word_embeddings=False,
    )


PROMPTS = [[3, 17, 92, 5], [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31], [77]]


def test_a_float32_moe_model_through_it_greedy_equals_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts batched, 24 greedy tokens each, fp32 on the CPU: the
    engine's experts run the library's kernel (counted), its tokens are
    transformers' token for token."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_qwen3_moe()).eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    expected = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                pad_token_id=0,
            )
            expected.append(out[0, len(prompt) :].tolist())
    calls = 0
    original = CpuMoeExperts.__call__

    def counted(self: CpuMoeExperts, *args: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(self, *args)

    monkeypatch.setattr(CpuMoeExperts, "__call__", counted)
    # The layer-by-layer forward (test_cpu_f32_stack: the stack's bits are its).
    monkeypatch.setattr(CpuF32Stack, "build", classmethod(lambda *_: None))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def serve() -> list[list[int]]:
        results: list[list[int]] = [[] for _ in PROMPTS]
        async with asyncstep.open_engine(
            tmp_path, device="cpu", dtype="float32", engine_process=False
        ) as engine:

            async def one(i: int) -> None:
                results[i] = (await engine.generate(PROMPTS[i], params)).token_ids

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
        return results

    assert trio.run(serve) == expected
    assert calls > 0


def mxfp4_weights(
    experts: int, size: int, inter: int, low: int = 118, high: int = 126
) -> tuple[Mxfp4Weight, Mxfp4Weight]:
    """Random codes (every one of the 16) and scales in ``[low, high]``."""
    generator = torch.Generator().manual_seed(3)

    def one(rows: int, cols: int) -> Mxfp4Weight:
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=generator)
        scales = torch.randint(low, high + 1, (experts, rows, cols // 32), generator=generator)
        return Mxfp4Weight.from_checkpoint(blocks.to(torch.uint8), scales.to(torch.uint8))

    return one(2 * inter, size), one(size, inter)


@pytest.mark.parametrize("isa", ["library", *BUILDS])
def test_bfloat16_weights_give_the_float32_kernel_s_bits(isa: str, tmp_path: Path) -> None:
    """bfloat16 experts (16 experts of top 4, H 64, I 96; swigluoai and
    biases, and silu): bit for bit the float32 call on the widened weights,
    float32 rows and bfloat16 ones (widened, the sums rounded once), every
    row alone and in batches, on 1 and 2 threads."""
    experts = EXPERTS if isa == "library" else build(isa, tmp_path)
    assert experts is not None
    w13, w2 = (w.bfloat16() for w in weights(16, 64, 96))
    bias13, bias2 = torch.randn(16, 192) * 0.1, torch.randn(16, 64) * 0.1
    x, topk_weights, topk_ids = route(40, 16, 4)
    threads = torch.get_num_threads()
    try:
        for activation, biases in (("swigluoai", (bias13, bias2)), ("silu", (None, None))):
            torch.set_num_threads(1)
            dense = experts(x, w13.float(), w2.float(), topk_weights, topk_ids, activation, *biases)
            alone = torch.cat(
                [experts(x[r : r + 1], w13, w2, topk_weights[r : r + 1], topk_ids[r : r + 1],
                         activation, *biases)
                 for r in range(40)]
            )  # fmt: skip
            assert torch.equal(alone, dense), activation
            rows16 = experts(x.bfloat16(), w13, w2, topk_weights, topk_ids, activation, *biases)
            widened = experts(
                x.bfloat16().float(), w13.float(), w2.float(), topk_weights, topk_ids,
                activation, *biases,
            )  # fmt: skip
            assert rows16.dtype == torch.bfloat16 and torch.equal(rows16, widened.bfloat16())
            for count in (1, 2):
                torch.set_num_threads(count)
                for batch in (2, 7, 33):
                    rows = slice(3, 3 + batch)
                    args = (x[rows], w13, w2, topk_weights[rows], topk_ids[rows])
                    got = experts(*args, activation, *biases)
                    assert torch.equal(got, dense[rows]), (activation, count, batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ["library", *BUILDS])
def test_mxfp4_weights_give_the_dense_kernel_s_bits(isa: str, tmp_path: Path) -> None:
    """MXFP4 experts kept packed (16 experts of top 4, H 64, I 96: one to
    ~40 rows an expert, every tile shape; swigluoai and biases, and silu):
    bit for bit the dense call on the dequantized float32 weights, every
    row alone and in batches from several offsets, on 1 and 2 threads."""
    experts = EXPERTS if isa == "library" else build(isa, tmp_path)
    assert experts is not None
    p13, p2 = mxfp4_weights(16, 64, 96)
    d13, d2 = p13.dequantize(), p2.dequantize()
    bias13, bias2 = torch.randn(16, 192) * 0.1, torch.randn(16, 64) * 0.1
    x, topk_weights, topk_ids = route(120, 16, 4)
    threads = torch.get_num_threads()
    try:
        for activation, biases in (("swigluoai", (bias13, bias2)), ("silu", (None, None))):
            torch.set_num_threads(1)
            dense = experts(x, d13, d2, topk_weights, topk_ids, activation, *biases)
            alone = torch.cat(
                [experts(x[r : r + 1], p13, p2, topk_weights[r : r + 1], topk_ids[r : r + 1],
                         activation, *biases)
                 for r in range(120)]
            )  # fmt: skip
            assert torch.equal(alone, dense), activation
            for count in (1, 2):
                torch.set_num_threads(count)
                for batch in (2, 7, 33, 120):
                    for start in sorted({0, 5, 120 - batch}):
                        rows = slice(start, start + batch)
                        args = (x[rows], p13, p2, topk_weights[rows], topk_ids[rows])
                        got = experts(*args, activation, *biases)
                        assert torch.equal(got, dense[rows]), (activation, count, batch, start)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ["library", *BUILDS])
def test_mxfp4_scales_at_float32_s_ends_decode_as_the_dequantized_weights(
    isa: str, tmp_path: Path
) -> None:
    """Scales 0 (2^-127: subnormal products), 1, 254 and 255 (products
    overflowing to inf; 0 * inf NaN): each decoded value equals
    :meth:`Mxfp4Weight.dequantize`'s, so the outputs are the dense call's
    bits (infs and NaNs where it has them)."""
    experts = EXPERTS if isa == "library" else build(isa, tmp_path)
    assert experts is not None
    x, topk_weights, topk_ids = route(5, 4, 2)
    for low, high in ((0, 1), (250, 255)):
        p13, p2 = mxfp4_weights(4, 64, 32, low, high)
        s13, s2 = mxfp4_weights(4, 64, 32)
        for w13, w2 in ((p13, s2), (s13, p2)) if low else ((p13, p2),):
            got = experts(x, w13, w2, topk_weights, topk_ids)
            dense = experts(x, w13.dequantize(), w2.dequantize(), topk_weights, topk_ids)
            assert torch.equal(got.nan_to_num(7.0), dense.nan_to_num(7.0)), (low, high)
            assert torch.equal(got.isnan(), dense.isnan())


def test_mxfp4_layouts_are_the_checkpoint_s_values() -> None:
    """The repacked HF blocks dequantize to ``dequantize_mxfp4``'s values;
    narrowing keeps whole blocks."""
    from asyncstep.models.mxfp4 import dequantize_mxfp4

    generator = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), generator=generator).to(torch.uint8)
    scales = torch.randint(100, 150, (2, 3, 4), generator=generator).to(torch.uint8)
    weight = Mxfp4Weight.from_checkpoint(blocks, scales)
    assert torch.equal(weight.dequantize(), dequantize_mxfp4(blocks, scales, torch.float32))
    assert weight.shape == (2, 3, 128) and weight.nbytes == 2 * 3 * (64 + 4)
    assert torch.equal(weight.narrow(2, 32, 64).dequantize(), weight.dequantize()[..., 32:96])
    assert torch.equal(weight.narrow(1, 1, 2).dequantize(), weight.dequantize()[:, 1:3])
    with pytest.raises(ValueError, match="columns 16\\+32 are not whole blocks of 32"):
        weight.narrow(2, 16, 32)
    with pytest.raises(ValueError, match=r"blocks \(2, 3, 4, 8\) must be scales"):
        Mxfp4Weight.from_checkpoint(blocks[..., :8], scales)


@pytest.mark.parametrize(
    ("scoring", "renormalize"),
    [("softmax", True), ("softmax", False), ("sigmoid", True), ("topk_softmax", False)],
)
def test_the_router_picks_the_reference_s_experts(scoring: str, renormalize: bool) -> None:
    """The library's router (the CPU op set's and the float32 stack's): the
    reference's ids, its weights within float32 rounding, each pair counted;
    tied scores go to the lower expert id (torch's topk orders a row of
    ties its own way), a row of NaNs still picks k distinct ids in range;
    the CPU op set routes through it."""
    router = moe_router()
    assert router is not None
    torch.manual_seed(0)
    logits = torch.randn(37, 16) * 3
    logits[5] = 0.25  # every expert tied
    logits[6, 3] = logits[6, 9] = 9.0  # two tied at the top
    counts = torch.zeros(16, dtype=torch.int64)
    weights, ids = router(logits, 4, renormalize=renormalize, scoring_func=scoring, counts=counts)
    want_weights, want_ids = select_experts(
        logits, 4, renormalize=renormalize, scoring_func=scoring
    )
    untied = [row for row in range(len(logits)) if row != 5]
    assert torch.equal(ids[untied], want_ids[untied]) and ids.dtype == torch.int32
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)
    assert ids[5].tolist() == [0, 1, 2, 3] and ids[6, :2].tolist() == [3, 9]
    assert torch.equal(counts, torch.bincount(ids.flatten().long(), minlength=16))
    op_weights, op_ids = CpuOps(library.load_cpu_kernels().layer_ops).select_experts(  # type: ignore[union-attr]
        logits.to(torch.bfloat16), 4, renormalize=renormalize, scoring_func=scoring
    )
    bf_weights, bf_ids = router(
        logits.to(torch.bfloat16), 4, renormalize=renormalize, scoring_func=scoring
    )
    assert torch.equal(op_ids, bf_ids) and torch.equal(op_weights, bf_weights)
    nans = torch.full((2, 16), float("nan"))
    _, nan_ids = router(nans, 4, renormalize=renormalize, scoring_func=scoring)
    assert all(
        sorted(set(row)) == sorted(row) and min(row) >= 0 and max(row) < 16
        for row in nan_ids.tolist()
    )


def test_the_router_refuses_bad_arguments_in_one_line() -> None:
    router = moe_router()
    assert router is not None
    logits = torch.randn(4, 8)
    for bad in (
        lambda: router(logits, 9, renormalize=True),
        lambda: router(logits, 0, renormalize=True),
        lambda: router(logits, 2, renormalize=True, scoring_func="tanh"),
        lambda: router(logits[0], 2, renormalize=True),
        lambda: router(logits, 2, renormalize=True, counts=torch.zeros(7, dtype=torch.int64)),
    ):
        with pytest.raises(ValueError, match=r"^[^\n]+$"):
            bad()
