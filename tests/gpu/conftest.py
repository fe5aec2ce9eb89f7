"""Fixtures of the Triton kernel tests.

``row_wise_interpreted_dot``: under the Triton interpreter, ``tl.dot`` is
``np.matmul``, whose float32 BLAS (OpenBLAS's AVX2 sgemm: its Haswell
kernels) sums a row in an order that depends on the row's place in the
tile, a stand-in for the GPU's MMA (one order for every row) that breaks
the batch-invariance tests' bit-for-bit checks. The fixture swaps in a dot
that sums every element's float32 products in K order (the same for any
row at any place); the kernels' own order around it is what those tests
check. Off the interpreter it does nothing.
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
        acc = d.data.dtype  # [M, K, N] products, C-contiguous: summed over K in order
        a32, b32 = np.ascontiguousarray(a.data, acc), np.ascontiguousarray(b.data, acc)
        products = a32[:, :, None] * b32[None, :, :]
        return interpreter.TensorHandle(products.sum(axis=1) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
