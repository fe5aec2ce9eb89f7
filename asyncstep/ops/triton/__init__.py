"""The Triton kernels (CUDA; on the CPU under ``TRITON_INTERPRET=1`` in the
tests) and their op set (:mod:`.ops`): paged attention and the KV-cache
store (:mod:`.attention`; its kernels in :mod:`.attention_kernels` and
:mod:`.decode_kernels`), the residual add + RMSNorm, the q/k norms and ``silu * up``
(:mod:`.fused`), the rotary (+ store) (:mod:`.rotary`), the one-row GEMV of dense 16-bit weights
(:mod:`.gemv`), Q4 / Q8 weights (:mod:`.quant`; their layouts in
:mod:`.quant_layout`, their kernels in :mod:`.quant_kernels`, the int8
activations' packed math in :mod:`.quant_packed`), programmatic dependent
launch between the decode step's kernels (:mod:`.pdl`), the grammar
bitmask (:mod:`.grammar_kernel`), the fused mixture of experts
(:mod:`.fused_moe`; its kernels in :mod:`.fused_moe_kernels`) and the batch-invariant op set
(:mod:`.invariant_ops`: its matmul :mod:`.invariant_matmul`, RMSNorm
:mod:`.invariant_norm`, attention :mod:`.invariant_attention` and its
kernels :mod:`.invariant_attention_kernels`). triton is imported by the kernel modules,
never by this package: it is optional on the CPU.

May import torch, triton, :mod:`asyncstep.device` and :mod:`asyncstep.ops`'
base, reference and packed formats.
"""

from asyncstep.ops.triton.ops import TritonOps

__all__ = ["TritonOps"]
