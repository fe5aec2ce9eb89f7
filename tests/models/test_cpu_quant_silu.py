"""The decoder stack's gate_up matmul with silu * up on its sums
(``asyncstep_q_matmul_silu_rows`` in ``cpu_quant.c``): its codes are
silu(gate) * up of the quantized matmul's gate and up sums, quantized as
the down matmul's input (within the two levels' rounding of the float32
values); a row's codes are the same alone and among 2048 rows; the AVX2
build (CI's machine, the library's flags) gives the vector build's bits."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from gguf_weights import q4_1_weight

import asyncstep
from asyncstep.cpu_features import cpu_flags
from asyncstep.ops.cpu import library
from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.cpu.quant import CpuQuantWeight, pack_q4_cpu

KERNELS = load_cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: the library is off")
BLOCK = 32
HIDDEN, INTERMEDIATE = 576, 96


class QWeight(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
    ]


class QuantizedRows(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("s", ctypes.c_void_p),
        ("in_features", ctypes.c_int64),
        ("levels", ctypes.c_int64),
    ]


class QOutput(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int64),
        ("stride", ctypes.c_int64),
        ("bias", ctypes.c_void_p),
    ]


class Codes:
    """QuantizedRows of ``rows`` x ``features`` in tensors: q ``[rows * levels,
    features]`` int8, d ``[rows * levels, blocks]``, s ``[rows, blocks]``."""

    def __init__(self, rows: int, features: int, levels: int) -> None:
        blocks = features // BLOCK
        self.q = torch.zeros(rows * levels, features, dtype=torch.int8)
        self.d = torch.zeros(rows * levels, blocks)
        self.s = torch.zeros(rows, blocks)
        self.levels = levels
        self.struct = QuantizedRows(
            self.q.data_ptr(), self.d.data_ptr(), self.s.data_ptr(), features, levels
        )

    def values(self) -> torch.Tensor:
        """The values the codes stand for: sum over levels of code x scale."""
        rows = self.s.shape[0]
        q = self.q.double().reshape(rows, self.levels, -1, BLOCK)
        d = self.d.double().reshape(rows, self.levels, -1, 1)
        return (q * d).sum(dim=1).reshape(rows, -1)


def weight_struct(packed: CpuQuantWeight) -> QWeight:
    return QWeight(0, packed.data.data_ptr(), packed.out_features, packed.in_features)


def quantized(lib: ctypes.CDLL, x: torch.Tensor, levels: int) -> Codes:
    codes = Codes(x.shape[0], x.shape[1], levels)
    lib.asyncstep_q_quantize(
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_int64(0),
        ctypes.c_int64(x.stride(0)),
        ctypes.c_int64(x.shape[0]),
        ctypes.byref(codes.struct),
    )
    return codes


def fused(lib: ctypes.CDLL, packed: CpuQuantWeight, x: torch.Tensor) -> Codes:
    """silu(gate) * up of x's rows, as the stack's down matmul takes it."""
    codes = quantized(lib, x, packed.levels)
    out = Codes(x.shape[0], packed.out_features // 2, packed.levels)
    w = weight_struct(packed)
    lib.asyncstep_q_matmul_silu_rows(
        ctypes.byref(w), ctypes.byref(codes.struct), ctypes.c_int64(x.shape[0]),
        ctypes.byref(out.struct),
    )  # fmt: skip
    return out


def gate_up(lib: ctypes.CDLL, packed: CpuQuantWeight, x: torch.Tensor) -> torch.Tensor:
    """The quantized matmul's float32 [rows, 2 I] sums (the unfused path's)."""
    codes = quantized(lib, x, packed.levels)
    out = torch.empty(x.shape[0], packed.out_features)
    w = weight_struct(packed)
    where = QOutput(out.data_ptr(), 0, out.stride(0), None)
    lib.asyncstep_q_matmul_rows(
        ctypes.byref(w), ctypes.byref(codes.struct), ctypes.c_int64(x.shape[0]),
        ctypes.byref(where),
    )  # fmt: skip
    return out


def packed_gate_up(levels: int) -> CpuQuantWeight:
    packed = pack_q4_cpu(q4_1_weight(2 * INTERMEDIATE, HIDDEN), torch.float32, 4096, levels)
    assert packed is not None
    return packed


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("rows", [1, 13, 64])
def test_the_codes_are_silu_times_up_of_the_matmuls_sums(levels: int, rows: int) -> None:
    assert KERNELS is not None
    lib = KERNELS.library
    packed = packed_gate_up(levels)
    x = torch.randn(rows, HIDDEN)
    out = fused(lib, packed, x)
    sums = gate_up(lib, packed, x).double()
    gate, up = sums[:, :INTERMEDIATE], sums[:, INTERMEDIATE:]
    expected = torch.nn.functional.silu(gate) * up
    # a code's rounding: half the last level's scale (a whole one where the
    # second level's code is clamped to +-127), per block; float32's a few ulps
    step = out.d.double().reshape(rows, levels, -1)[:, -1].repeat_interleave(BLOCK, dim=1)
    rounding = step / 2 if levels == 1 else step
    assert ((out.values() - expected).abs() <= rounding + 1e-5 * expected.abs() + 1e-7).all()
    # the block sums as the quantizer writes them: d_last * (sum of the codes)
    assert torch.allclose(out.s.double(), out.values().reshape(rows, -1, BLOCK).sum(-1))


def rows_of(codes: Codes, first: int, count: int) -> tuple[torch.Tensor, ...]:
    lv = codes.levels
    return (
        codes.q[first * lv : (first + count) * lv],
        codes.d[first * lv : (first + count) * lv],
        codes.s[first : first + count],
    )


#: Tiles of 12 (AVX-512) or 8 / 4 (AVX2) rows; chunks of ~256 KB of codes
#: (216 rows at K = 576, two levels), a ragged last one included.
BATCHES = (13, 217, 2048)
PICKS = (0, 11, 12, 215, 216, 2047)


def assert_rows_alone_equal_among_others(lib: ctypes.CDLL, x: torch.Tensor, levels: int) -> None:
    packed = packed_gate_up(levels)
    for batch in BATCHES:
        for start in (0, len(x) - batch):
            among = fused(lib, packed, x[start : start + batch])
            for i in PICKS:
                if start <= i < start + batch:
                    alone = fused(lib, packed, x[i : i + 1])
                    pairs = zip(rows_of(among, i - start, 1), rows_of(alone, 0, 1), strict=True)
                    assert all(torch.equal(a, b) for a, b in pairs), (batch, i)


@pytest.mark.parametrize("levels", [1, 2])
def test_a_row_gets_the_same_codes_alone_and_among_2048(levels: int) -> None:
    assert KERNELS is not None
    assert_rows_alone_equal_among_others(KERNELS.library, torch.randn(2048, HIDDEN), levels)


def avx2_build(tmp_path: Path) -> ctypes.CDLL:
    """cpu_quant.c alone with the library's flags for an AVX2 CPU (CI's)."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU does not run the AVX2 build")
    source = Path(asyncstep.__file__).parent / "ops/cpu/cpu_quant.c"
    target = tmp_path / "cpu_quant_avx2.so"
    flags = [*library.BASE_FLAGS, *library.ISA_FLAGS["avx2"], "-mno-avx512f"]
    subprocess.run(
        [compiler, *flags, str(source), "-o", str(target), *library.LIBS],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(target))
    assert lib.asyncstep_qmatmul_fast() == 2  # QMATMUL_ISA_AVX2
    return lib


@pytest.mark.parametrize("levels", [1, 2])
def test_the_avx2_build_gives_the_vector_builds_codes(levels: int, tmp_path: Path) -> None:
    assert KERNELS is not None
    lib = avx2_build(tmp_path)
    x = torch.randn(2048, HIDDEN)
    assert_rows_alone_equal_among_others(lib, x, levels)
    packed = packed_gate_up(levels)
    ours, theirs = fused(KERNELS.library, packed, x), fused(lib, packed, x)
    for a, b in zip(rows_of(ours, 0, len(x)), rows_of(theirs, 0, len(x)), strict=True):
        assert torch.equal(a, b)
