"""The CPU library's mixture-of-experts experts (``cpu_moe.c``, loaded by
:func:`~asyncstep.ops.cpu.library.load_cpu_kernels`): a layer's float32
experts in one call, the reference's contract
(:func:`~asyncstep.ops.torch_moe.fused_experts`: silu, no biases) with its
sums in its order (each pair weighted in float32, a token's pairs summed
from 0 in the order of their experts), the matmuls each row alone in one K
order (a row's result does not depend on the other rows: issue 40), no
python loop over the experts. Its use: the CPU op set's experts where the
hidden rows and the weights are float32 (:meth:`CpuMoeExperts.applies`).
Imports torch and the library's loader only.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from asyncstep.ops.cpu.library import load_cpu_kernels

__all__ = ["CpuMoeExperts", "moe_experts"]

#: The C side's ``MoeArgs``: 8 bytes per field, pointers as integers.
_ARGS = struct.Struct(
    "<qq"  # hidden, its row stride
    "qq"  # w13, w2
    "qqq"  # experts, hidden size, intermediate size
    "qq"  # topk ids, topk weights
    "qq"  # tokens, top k
    "qq"  # scratch, out
    "q"  # threads
)
#: The most experts a token may pick (the C side sorts a token's pairs on its stack).
MAX_TOP_K = 64


class CpuMoeExperts:
    """The library's grouped experts (``asyncstep_moe_experts``)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._experts = library.asyncstep_moe_experts
        self._experts.argtypes = [ctypes.c_char_p]
        self._experts.restype = ctypes.c_int
        #: float32 lanes per vector of the build (H and I must be multiples).
        self.lanes = int(library.asyncstep_moe_lanes())

    def applies(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str,
        biased: bool,
    ) -> bool:
        """Whether the call takes these: float32 CPU tensors, contiguous
        weights, silu, no biases, whole vectors of H and I."""
        tensors = (hidden, w13, w2)
        return (
            activation == "silu"
            and not biased
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and hidden.dim() == 2
            and hidden.stride(1) == 1
            and w13.is_contiguous()
            and w2.is_contiguous()
            and hidden.shape[1] % self.lanes == 0
            and w2.shape[2] % self.lanes == 0
            and topk_ids.shape[1] <= MAX_TOP_K
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The experts' weighted sum ``[T, H]`` float32 (see the module doc)."""
        if not self.applies(hidden, w13, w2, topk_ids, "silu", False):
            raise ValueError("the CPU experts take float32 rows and contiguous float32 weights")
        num_experts, two_inter, size = w13.shape
        inter = two_inter // 2
        if size != hidden.shape[1] or w2.shape != (num_experts, size, inter):
            raise ValueError(f"expert weights {tuple(w13.shape)}, {tuple(w2.shape)} do not match")
        tokens, top_k = topk_ids.shape
        if topk_weights.shape != topk_ids.shape or tokens != hidden.shape[0]:
            raise ValueError(
                f"{tokens} rows of {top_k} expert ids, weights {tuple(topk_weights.shape)}, "
                f"hidden {tuple(hidden.shape)}: they must match"
            )
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.float().contiguous()
        pairs = tokens * top_k
        scratch = torch.empty(pairs * (3 * inter + size))
        out = torch.empty(tokens, size)
        args = _ARGS.pack(
            hidden.data_ptr(),
            hidden.stride(0),
            w13.data_ptr(),
            w2.data_ptr(),
            num_experts,
            size,
            inter,
            ids.data_ptr(),
            weights.data_ptr(),
            tokens,
            top_k,
            scratch.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        status = self._experts(args)
        if status == -2:
            raise ValueError(f"expert ids must lie in [0, {num_experts})")
        if status != 0:
            raise MemoryError("the CPU experts found no scratch memory")
        return out


@functools.cache
def moe_experts() -> CpuMoeExperts | None:
    """The library's grouped experts (the library built on first use); None
    where the library is off or does not build."""
    kernels = load_cpu_kernels()
    return None if kernels is None else CpuMoeExperts(kernels.library)
