"""The CPU library's dense float32 matmul (``cpu_dense_f32.c``): float32
sums a few ulps from float64's, in every build this machine compiles
(AVX-512, AVX2, plain C, with the library's flags), every build the same
bits as the others; a row's outputs the same bits alone and among 2..256
rows, on 1 and 2 threads (issue 40); the CPU op set takes it for float32
projections (bias too) and the float32 LM head under ``batch_invariant``,
torch's ``F.linear`` with it off; bad inputs refused in one line."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import asyncstep
from asyncstep.cpu_features import cpu_flags
from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.dense_f32 import CpuDenseF32Matmul, dense_f32_matmul
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.ops import CpuOps
from asyncstep.ops.select import select_ops

MATMUL = dense_f32_matmul()
pytestmark = pytest.mark.skipif(MATMUL is None, reason="no C compiler: the library is off")

#: Each build: its target flags and the CPU flags it needs.
BUILDS: dict[str, tuple[tuple[str, ...], set[str]]] = {
    "AVX-512": (("-march=native",), {"avx512f", "avx512vl"}),
    "AVX2": (("-mavx2", "-mfma", "-mf16c"), {"avx2", "fma"}),
    "plain C": ((), set()),
}


def build(isa: str, tmp_path: Path) -> CpuDenseF32Matmul:
    """cpu_dense_f32.c alone, built for ``isa`` with the library's flags
    (skipped where this CPU lacks it)."""
    flags, needs = BUILDS[isa]
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU has no {', '.join(sorted(missing))}: the {isa} build is not run")
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    source = Path(asyncstep.__file__).parent / "ops/cpu/cpu_dense_f32.c"
    target = tmp_path / f"cpu_dense_f32_{isa.replace(' ', '_')}.so"
    for openmp in (["-fopenmp"], []):  # threads where the compiler has OpenMP
        done = subprocess.run(
            [compiler, *library.BASE_FLAGS, *flags, *openmp, str(source), "-o", str(target), "-lm"],
            capture_output=True,
        )
        if done.returncode == 0:
            break
    done.check_returncode()
    built = CpuDenseF32Matmul(ctypes.CDLL(str(target)))
    assert built.isa == isa
    return built


def case(rows: int, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    return x, weight


def within_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """float32 sums of K products: within K ulps of the sum of magnitudes."""
    expected = x.double() @ weight.double().T
    scale = x.double().abs() @ weight.double().abs().T
    bound = x.shape[1] * 2.0**-24 * scale
    return bool(((got.double() - expected).abs() <= bound).all())


def with_threads(count: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ["library", *BUILDS])
@pytest.mark.parametrize("in_features", [8, 61, 512])
def test_every_build_computes_the_float64_sums(isa: str, in_features: int, tmp_path: Path) -> None:
    """1 to 13 rows (every tile shape and its leftovers), K whole vectors
    or not: float64's sums to float32's precision."""
    matmul = MATMUL if isa == "library" else build(isa, tmp_path)
    assert matmul is not None
    for rows in (1, 2, 3, 4, 5, 7, 13):
        x, weight = case(rows, 37, in_features, seed=rows)
        got = matmul(x, weight)
        assert got.dtype == torch.float32 and got.shape == (rows, 37)
        assert within_float64(got, x, weight), (rows, in_features)


def test_every_build_gives_the_same_bits(tmp_path: Path) -> None:
    """AVX-512, AVX2 and plain C (those this CPU runs): one order for every
    output, so one result, the library's too."""
    assert MATMUL is not None
    x, weight = case(23, 53, 77, seed=3)
    expected = MATMUL(x, weight)
    ran = 0
    for isa, (_, needs) in BUILDS.items():
        if needs - cpu_flags():
            continue
        assert torch.equal(build(isa, tmp_path)(x, weight), expected), isa
        ran += 1
    assert ran >= 1


@pytest.mark.parametrize("isa", ["library", "AVX2", "plain C"])
def test_a_row_s_outputs_do_not_depend_on_its_batch(isa: str, tmp_path: Path) -> None:
    """Every row of 256, computed alone and in batches of 2..256 rows from
    several offsets, on 1 and 2 threads: the same bits."""
    matmul = MATMUL if isa == "library" else build(isa, tmp_path)
    assert matmul is not None
    x, weight = case(256, 100, 72, seed=4)
    alone = with_threads(1, lambda: torch.cat([matmul(x[r : r + 1], weight) for r in range(256)]))
    for count in (1, 2):
        for batch in (2, 3, 5, 8, 16, 17, 64, 255, 256):
            for start in sorted({0, 1, 256 - batch}):
                rows = slice(start, start + batch)
                got = with_threads(count, partial(matmul, x[rows], weight))
                assert torch.equal(got, alone[rows]), (count, batch, start)
    assert within_float64(alone, x, weight)


def test_a_large_weight_streams_with_the_same_bits() -> None:
    """A weight past the caches (an LM head: 16 MB, read a row at a time
    for up to 4 rows of x; for more, the first tile of rows against each
    block a row at a time) gives the tiles' bits of the weight in parts
    that fit (4 MB) for rows 1..13, on 1 and 2 threads."""
    assert MATMUL is not None
    x, weight = case(13, 8192, 512, seed=5)
    parts = torch.cat([MATMUL(x, part) for part in weight.split(2048)], dim=1)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 2, 4, 5, 6, 13):
                assert torch.equal(MATMUL(x[:rows], weight), parts[:rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_are_read_in_place() -> None:
    """Rows of x and of the weight with a row stride wider than K, and an
    output beside the others: the contiguous copies' bits."""
    assert MATMUL is not None
    x, weight = case(9, 40, 48, seed=6)
    wide_x = torch.zeros(9, 64)
    wide_x[:, :48] = x
    wide_w = torch.zeros(40, 50)
    wide_w[:, :48] = weight
    assert torch.equal(MATMUL(wide_x[:, :48], wide_w[:, :48]), MATMUL(x, weight))


def test_bad_inputs_are_refused_in_one_line() -> None:
    assert MATMUL is not None
    x, weight = case(3, 8, 16)
    with pytest.raises(ValueError, match="takes float32 CPU rows"):
        MATMUL(x.bfloat16(), weight)
    with pytest.raises(ValueError, match="takes float32 CPU rows"):
        MATMUL(x, weight[:, :8])
    with pytest.raises(ValueError, match="takes float32 CPU rows"):
        MATMUL(x, weight.T.contiguous().T)
    assert MATMUL(x[:0], weight).shape == (0, 8)


def test_the_op_set_takes_float32_projections_and_the_head() -> None:
    """``CpuOps.linear`` (3-D x, a bias added to the sums) and ``logits``
    through the library with ``invariant_float32``; ``F.linear`` without;
    select_ops turns it on by default where the build is a blocked one and
    as ``batch_invariant`` says otherwise."""
    kernels = load_cpu_kernels()
    assert kernels is not None and MATMUL is not None
    x, weight = case(10, 24, 40, seed=7)
    bias = torch.randn(24)
    on = CpuOps(kernels.layer_ops)
    got = on.linear(x.view(2, 5, 40), weight, None, bias)
    assert torch.equal(got, (MATMUL(x, weight) + bias).view(2, 5, 24))
    assert torch.equal(on.logits(x, weight, None), MATMUL(x, weight))
    off = CpuOps(kernels.layer_ops, invariant_float32=False)
    assert torch.equal(off.linear(x, weight, None, bias), F.linear(x, weight, bias))
    assert torch.equal(off.logits(x, weight, None), F.linear(x, weight))
    half = on.linear(x.bfloat16(), weight.bfloat16(), None)
    assert half.dtype == torch.bfloat16
    cpu = torch.device("cpu")
    chosen = {
        flag: select_ops(cpu, "cpu", fused_kernels=True, batch_invariant=flag)
        for flag in (True, False, None)
    }
    assert [ops.invariant_float32 for ops in chosen.values()] == [True, False, MATMUL.fast]  # type: ignore[attr-defined]


def test_the_library_built_for_avx2_runs_the_avx2_matmul(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, avx2_kernels_cache: Path
) -> None:
    """``ASYNCSTEP_CPU_KERNELS_ISA=avx2``: the whole library's float32
    matmul is the AVX2 build, the same bits as this machine's."""
    if {"avx2", "fma", "f16c"} - cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    assert MATMUL is not None
    monkeypatch.setenv(library.CACHE_ENV, str(avx2_kernels_cache))
    monkeypatch.setenv(library.ISA_ENV, "avx2")
    load_cpu_kernels.cache_clear()
    try:
        kernels = load_cpu_kernels()
    finally:
        load_cpu_kernels.cache_clear()
    assert kernels is not None
    matmul = CpuDenseF32Matmul(kernels.library)
    assert matmul.isa == "AVX2"
    x, weight = case(20, 30, 64, seed=8)
    assert torch.equal(matmul(x, weight), MATMUL(x, weight))
