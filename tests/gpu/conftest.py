"""Fixtures of the Triton kernel tests.

``row_wise_interpreted_dot``: under the Triton interpreter, ``tl.dot`` is
``np.matmul``, whose float32 BLAS (OpenBLAS's AVX2 sgemm: its Haswell
kernels) sums a row in an order that depends on the row's place in the
tile, a stand-in for the GPU's MMA (one order for every row) that breaks
the batch-invariance tests' bit-for-bit checks. The fixture swaps in a dot
that, as the tensor cores chain their MMA steps into the accumulator, adds
every element's float32 products to it one feature at a time in K order
(the same for any row at any place, and for any BLOCK_K); the kernels' own
order around it is what those tests check. Off the interpreter it does
nothing.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest


@pytest.fixture
def row_wise_interpreted_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    from triton.runtime import interpreter

    def create_dot(
        self: object, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any
    ) -> Any:
        acc = np.array(d.data, copy=True)
        a32, b32 = a.data.astype(acc.dtype), b.data.astype(acc.dtype)
        for k in range(a32.shape[1]):  # each product rounded, then added: no FMA
            acc += a32[:, k, None] * b32[None, k, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
