"""The CPU library's dense bfloat16 matmul (``cpu_dense.c``): float32 sums
of the bfloat16 weights (x rounded to bfloat16 only where AVX512-BF16's
vdpbf16ps runs), each output row computed alone, in every build this
machine compiles (AVX512-BF16, AVX512F, AVX2, plain C); the LM head of a
bfloat16 model writes its float32 logits with it."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import asyncstep
from asyncstep.cpu_features import cpu_flags
from asyncstep.models.layers.embedding import ParallelLMHead
from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.dense import CpuDenseMatmul, dense_matmul
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.ops import CpuOps
from asyncstep.ops.select import select_ops
from asyncstep.ops.slot import OpSetSlot

MATMUL = dense_matmul()
pytestmark = pytest.mark.skipif(MATMUL is None, reason="no C compiler: the library is off")

#: Each build and the flags that make it (on a machine whose CPU runs it).
BUILDS = {
    "AVX512-BF16": ("-march=native",),
    "AVX512F": ("-march=native", "-mno-avx512bf16"),
    "AVX2": ("-mavx2", "-mfma", "-mf16c"),
    "plain C": (),
}
NEEDS = {"AVX512-BF16": {"avx512_bf16", "avx512f"}, "AVX512F": {"avx512f"}, "AVX2": {"avx2", "fma"}}


def build(isa: str, tmp_path: Path) -> CpuDenseMatmul:
    """cpu_dense.c alone, built for ``isa`` (skipped where this CPU lacks it)."""
    missing = NEEDS.get(isa, set()) - cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))}: the {isa} build is not run")
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = Path(asyncstep.__file__).parent / "ops/cpu/cpu_dense.c"
    target = tmp_path / "cpu_dense.so"
    flags = ["-O2", "-std=gnu11", "-fPIC", "-shared", *BUILDS[isa]]
    for openmp in (["-fopenmp"], []):  # threads where the compiler has OpenMP
        done = subprocess.run(
            [compiler, *flags, *openmp, str(source), "-o", str(target)], capture_output=True
        )
        if done.returncode == 0:
            break
    done.check_returncode()
    built = CpuDenseMatmul(ctypes.CDLL(str(target)))
    assert built.isa == isa
    return built


def reference(x: torch.Tensor, weight: torch.Tensor, isa: str) -> torch.Tensor:
    """The contract in float64: AVX512-BF16 multiplies x rounded to bfloat16."""
    rows = x.bfloat16() if isa == "AVX512-BF16" else x
    return rows.double() @ weight.double().T


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("features", [64, 100, 576])
def test_every_build_computes_its_contract_row_by_row(
    isa: str, features: int, tmp_path: Path
) -> None:
    """float32 sums of exact products (a few ulps of the sum of magnitudes),
    rows 1..9 (across the tiles of 4) and widths not a multiple of 32; a
    row's outputs are the same alone and among the others, to the bit."""
    matmul = build(isa, tmp_path)
    weight = torch.randn(37, features).bfloat16()
    x = torch.randn(9, features)
    out = matmul(x, weight)
    magnitude = x.abs().double() @ weight.abs().double().T
    assert out.dtype == torch.float32
    assert ((out.double() - reference(x, weight, isa)).abs() <= 1e-5 * magnitude + 1e-6).all()
    for rows in range(1, 9):
        assert torch.equal(matmul(x[:rows], weight), out[:rows])
    assert torch.equal(matmul(x[5:6], weight), out[5:6])
    assert torch.equal(matmul(x.bfloat16(), weight), matmul(x.bfloat16().float(), weight))
    assert torch.equal(matmul(x, weight, torch.bfloat16), out.bfloat16())


def test_bad_inputs_are_refused_in_one_line() -> None:
    assert MATMUL is not None
    weight = torch.randn(16, 64).bfloat16()
    with pytest.raises(ValueError, match="float32 or bfloat16 rows"):
        MATMUL(torch.randn(2, 64).half(), weight)
    with pytest.raises(ValueError, match="the weight must be bfloat16"):
        MATMUL(torch.randn(2, 64), weight.float())
    with pytest.raises(ValueError, match="64 features, the weight 32"):
        MATMUL(torch.randn(2, 64), weight[:, :32].contiguous())
    assert MATMUL(torch.randn(0, 64), weight).shape == (0, 16)


def test_a_bfloat16_lm_head_writes_float32_logits() -> None:
    """torch's bfloat16 matmul would round them to bfloat16 (steps of 0.125
    at 20); the library's keep float32's precision."""
    kernels = load_cpu_kernels()
    assert kernels is not None
    head = ParallelLMHead(300, 64, torch.bfloat16, ops=OpSetSlot(CpuOps(kernels.layer_ops)))
    head.weight.data.copy_(torch.randn(300, 64) * 2)
    hidden = torch.randn(3, 64).bfloat16()
    logits = head.compute_logits(hidden)
    exact = hidden.double() @ head.weight.double().T
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-4
    rounded = torch.nn.functional.linear(hidden, head.weight)
    assert (rounded.double() - exact).abs().max() > 1e-3  # what it would have been


#: Batch sizes a row is computed in (across the tiles of 4 rows and 6 weight rows).
BATCHES = (1, 3, 17, 64, 200)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_s_outputs_do_not_depend_on_its_batch(
    isa: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    """Every row of 200, computed in batches of 1, 3, 17, 64 and 200 rows from
    any offset, from rows of x and of the weight with a stride: the same bits
    (one K order for every row count), close to float64; K not a multiple of
    32, N not one of the tiles' 4, 6 or 16."""
    matmul = build(isa, tmp_path)
    weight = torch.randn(47, 120).bfloat16()[:, :100]  # a row stride of 120
    wide = torch.randn(200, 113).to(dtype)
    x = wide[:, :100]  # a row stride of 113
    full = matmul(x, weight)
    magnitude = x.abs().double() @ weight.abs().double().T
    assert ((full.double() - reference(x.float(), weight, isa)).abs() <= 1e-5 * magnitude).all()
    assert torch.equal(matmul(x.contiguous(), weight.contiguous()), full)
    for batch in BATCHES:
        for start in sorted({0, 5, 200 - batch}):
            if start + batch <= 200:
                rows = slice(start, start + batch)
                assert torch.equal(matmul(x[rows], weight), full[rows]), (batch, start)
    assert torch.equal(matmul(x, weight, torch.bfloat16), full.bfloat16())


def test_one_and_two_threads_give_the_same_bits() -> None:
    """The library's build (OpenMP) splits the weight's rows over threads,
    never K: the same outputs on 1 and 2 threads, alone or in a batch."""
    assert MATMUL is not None
    weight = torch.randn(1000, 200).bfloat16()
    x = torch.randn(64, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = MATMUL(x, weight)
        torch.set_num_threads(2)
        two = MATMUL(x, weight)
        alone = MATMUL(x[7:8], weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(alone, one[7:8])


def test_the_op_set_s_linear_runs_dense_bfloat16_weights_row_by_row() -> None:
    """``CpuOps.linear`` of a dense bfloat16 weight: the library's matmul in
    x's dtype for any leading shape, its bias added to the float32 sums, and
    a row's outputs the same alone and in a batch (F.linear's oneDNN blocks
    K by the row count)."""
    kernels = load_cpu_kernels()
    assert kernels is not None and MATMUL is not None
    ops = CpuOps(kernels.layer_ops)
    weight = torch.randn(300, 96).bfloat16()
    bias = torch.randn(300).bfloat16()
    x = torch.randn(2, 40, 96).bfloat16()
    y = ops.linear(x, weight, None)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 40, 300)
    assert torch.equal(y.view(80, 300), MATMUL(x.view(80, 96), weight, torch.bfloat16))
    assert torch.equal(ops.linear(x[1, 3:4], weight, None), y[1, 3:4])
    with_bias = ops.linear(x, weight, None, bias)
    expected = (MATMUL(x.view(80, 96), weight) + bias.float()).bfloat16().view(2, 40, 300)
    assert torch.equal(with_bias, expected)
    assert ops.linear(x.float(), weight, None).dtype == torch.float32
    half = ops.linear(x.half(), weight.half(), None)  # not the library's: F.linear
    assert torch.equal(half, torch.nn.functional.linear(x.half(), weight.half()))


@pytest.mark.parametrize("isa", ["library", "AVX512-BF16", "AVX512F", "AVX2"])
def test_every_tile_shape_gives_a_row_its_outputs_alone(isa: str, tmp_path: Path) -> None:
    """Weights of 1 to 13 rows (every count of weight rows a tile holds)
    against 1 to 12 rows of x (one row of W at a time up to 8 rows, then
    every count of x rows a tile holds; AVX2 packs W from 9), and 33 to 41
    (the packed paths' leftover tiles): each tile's shape is compiled on its own
    (the library's build with its reassociating flags too), and each gives
    a row the bits it has alone."""
    matmul = MATMUL if isa == "library" else build(isa, tmp_path)
    assert matmul is not None
    x = torch.randn(41, 64)
    for n in range(1, 14):
        weight = torch.randn(n, 64).bfloat16()
        alone = torch.cat([matmul(x[r : r + 1], weight) for r in range(41)])
        for rows in (*range(1, 13), *range(33, 42)):
            assert torch.equal(matmul(x[:rows], weight), alone[:rows]), (n, rows)


def test_where_the_outer_products_start_moves_no_bit(tmp_path: Path) -> None:
    """The AVX512-BF16 build's outer products from 2, 4, 16 or its own 32
    rows (``outer_min_rows``: 4 on an AMX Xeon): every row count from 1 to
    40, each row the bits it has alone (the other builds ignore the field)."""
    matmul = build("AVX512-BF16", tmp_path)
    x = torch.randn(40, 100)
    weight = torch.randn(37, 100).bfloat16()
    matmul.outer_min_rows = 0
    alone = torch.cat([matmul(x[r : r + 1], weight) for r in range(40)])
    for start in (0, 2, 4, 16):
        matmul.outer_min_rows = start
        for rows in range(1, 41):
            assert torch.equal(matmul(x[:rows], weight), alone[:rows]), (start, rows)


@pytest.mark.parametrize("isa", BUILDS)
def test_blocks_and_chunks_give_a_row_its_outputs_alone(isa: str, tmp_path: Path) -> None:
    """A wide K (kp 4096: blocks of 12 rows of W, chunks of 32 rows of x, so
    50 rows of W span 5 blocks and 70 rows of x 3 chunks), on 1 and 2
    threads: a row's outputs are the bits it has alone."""
    matmul = build(isa, tmp_path)
    weight = torch.randn(50, 4000).bfloat16()
    x = torch.randn(70, 4000)
    alone = torch.cat([matmul(x[r : r + 1], weight) for r in (0, 33, 69)])
    magnitude = x.abs().double() @ weight.abs().double().T
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            full = matmul(x, weight)
            assert torch.equal(full[[0, 33, 69]], alone), count
            assert torch.equal(matmul(x[30:40], weight), full[30:40]), count
    finally:
        torch.set_num_threads(threads)
    error = (full.double() - reference(x, weight, isa)).abs()
    assert (error <= 1e-5 * magnitude + 1e-6).all()


def test_the_library_builds_for_avx2_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, avx2_kernels_cache: Path
) -> None:
    """``ASYNCSTEP_CPU_KERNELS_ISA=avx2``: the whole library built as a CPU
    with AVX2 + FMA + F16C only builds it (its own cache key); its dense
    matmul is the AVX2 build, taken by default, the same bits as that build's."""
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
    matmul = CpuDenseMatmul(kernels.library)
    assert matmul.isa == "AVX2" and matmul.fast
    weight, x = torch.randn(40, 96).bfloat16(), torch.randn(70, 96)
    alone = build("AVX2", tmp_path)(x[3:4], weight)
    assert torch.equal(matmul(x, weight)[3:4], alone)
    assert torch.equal(matmul(x[3:4], weight), alone)


def test_batch_invariant_chooses_the_dense_matmul_on_the_cpu() -> None:
    """Dense bfloat16 projections run the library's invariant matmul when
    ``batch_invariant`` asks for it, torch's ``F.linear`` when it is off,
    and by default where the library's build is a blocked one (every build
    but plain C)."""
    cpu = torch.device("cpu")
    chosen = {
        asked: select_ops(cpu, "torch", fused_kernels=True, batch_invariant=asked)
        for asked in (True, False, None)
    }
    assert all(isinstance(ops, CpuOps) for ops in chosen.values())
    assert [ops.invariant_dense for ops in chosen.values()] == [True, False, MATMUL.fast]
    assert MATMUL.fast == (MATMUL.isa != "plain C")
    x, weight = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    off = chosen[False].linear(x, weight, None)
    assert torch.equal(off, torch.nn.functional.linear(x, weight))
