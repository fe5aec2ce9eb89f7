"""The Triton op set (CUDA; on the CPU under ``TRITON_INTERPRET=1`` in the
tests). Its kernels still live in :mod:`asyncstep.gpu`.

May import torch, triton (lazily), :mod:`asyncstep.gpu` and
:mod:`asyncstep.ops`' base and reference.
"""

from asyncstep.ops.triton.ops import TritonOps

__all__ = ["TritonOps"]
