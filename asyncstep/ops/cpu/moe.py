"""The CPU library's mixture-of-experts experts (``cpu_moe.c``) and router
(``cpu_moe_router.c``), loaded by
:func:`~asyncstep.ops.cpu.library.load_cpu_kernels`: a layer's float32
experts in one call, the reference's contract
(:func:`~asyncstep.ops.torch_moe.fused_experts`: silu, no biases) with its
sums in its order (each pair weighted in float32, a token's pairs summed
from 0 in the order of their experts), the matmuls each row alone in one K
order (a row's result does not depend on the other rows: issue 40), no
python loop over the experts; the activation silu or gpt-oss's
"swigluoai", with or without biases (the down bias added before the routing
weight). Its use: the CPU op set's experts where the hidden rows are float32
or bfloat16 (widened for the call, the float32 sums rounded once) and the
weights float32, bfloat16 (widened as they load: the float32 call's bits on
the widened weights) or MXFP4 kept packed
(:class:`~asyncstep.ops.mxfp4.Mxfp4Weight`: the outputs are then the
dense call's bits on the dequantized weights; :meth:`CpuMoeExperts.applies`).
Imports torch, the library's loader and the MXFP4 layout only.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from asyncstep.ops.cpu.library import load_cpu_kernels
from asyncstep.ops.mxfp4 import Mxfp4Weight

__all__ = ["CpuMoeExperts", "CpuMoeRouter", "moe_experts", "moe_router"]

#: The C side's ``MoeArgs``: 8 bytes per field, pointers as integers.
_ARGS = struct.Struct(
    "<qq"  # hidden, its row stride
    "qq"  # w13, w2
    "qqq"  # experts, hidden size, intermediate size
    "qq"  # topk ids, topk weights
    "qq"  # tokens, top k
    "qq"  # scratch, out
    "q"  # threads
    "qq"  # w13 scales, w2 scales (0: float32 weights)
    "qq"  # w13 bias, w2 bias (0: none)
    "q"  # activation
    "q"  # bfloat16 weights (1) or not (0)
)
#: The activations the C side computes, by its codes.
ACTIVATION_CODES = {"silu": 0, "swigluoai": 1}
#: The router scorings the C side computes, by its codes
#: (:func:`~asyncstep.ops.torch_moe.select_experts`' names).
SCORING_CODES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2}
#: The C side's ``RouteArgs``: 8 bytes per field, pointers as integers.
_ROUTE_ARGS = struct.Struct(
    "<qq"  # logits, their row stride
    "qqq"  # tokens, experts, top k
    "qq"  # scoring, renormalize
    "qqq"  # topk ids, topk weights, counts (0: none)
)
#: A projection the call takes: float32, bfloat16 or MXFP4 kept packed.
ExpertWeight = torch.Tensor | Mxfp4Weight
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
        w13: ExpertWeight,
        w2: ExpertWeight,
        topk_ids: torch.Tensor,
        activation: str,
    ) -> bool:
        """Whether the call takes these: float32 or bfloat16 CPU rows,
        contiguous weights both float32 or both bfloat16, or both MXFP4,
        silu or swigluoai, whole vectors of H and I."""
        packed = isinstance(w13, Mxfp4Weight) and isinstance(w2, Mxfp4Weight)
        dense = (
            isinstance(w13, torch.Tensor)
            and isinstance(w2, torch.Tensor)
            and w13.dtype in (torch.float32, torch.bfloat16)
            and w2.dtype == w13.dtype
            and all(w.device.type == "cpu" and w.is_contiguous() for w in (w13, w2))
        )
        return (
            activation in ACTIVATION_CODES
            and (packed or dense)
            and hidden.dtype in (torch.float32, torch.bfloat16)
            and hidden.device.type == "cpu"
            and hidden.dim() == 2
            and hidden.stride(1) == 1
            and hidden.shape[1] % self.lanes == 0
            and w2.shape[2] % self.lanes == 0
            and topk_ids.shape[1] <= MAX_TOP_K
        )

    def __call__(
        self,
        hidden: torch.Tensor,
        w13: ExpertWeight,
        w2: ExpertWeight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str = "silu",
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The experts' weighted sum ``[T, H]`` in hidden's dtype (see the
        module doc; bfloat16 rows are widened to float32 for the call, and
        its float32 sums rounded once)."""
        if not self.applies(hidden, w13, w2, topk_ids, activation):
            raise ValueError(
                "the CPU experts take float32 or bfloat16 rows, contiguous float32 or bfloat16 "
                "or MXFP4 weights, silu or swigluoai"
            )
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
        packed = isinstance(w13, Mxfp4Weight) and isinstance(w2, Mxfp4Weight)
        if packed and (size % 32 or inter % 32):
            raise ValueError(f"MXFP4 experts: H {size} and I {inter} must be multiples of 32")
        b13 = _bias(w13_bias, (num_experts, two_inter), "w13")
        b2 = _bias(w2_bias, (num_experts, size), "w2")
        rows = hidden.float()  # bfloat16 rows widened (exact); float32 ones as they are
        ids = topk_ids.to(torch.int32).contiguous()
        weights = topk_weights.float().contiguous()
        pairs = tokens * top_k
        scratch = torch.empty(pairs * size)  # the pairs' outputs (gate/up: the threads' own)
        out = torch.empty(tokens, size)
        args = _ARGS.pack(
            rows.data_ptr(),
            rows.stride(0),
            w13.codes.data_ptr() if isinstance(w13, Mxfp4Weight) else w13.data_ptr(),
            w2.codes.data_ptr() if isinstance(w2, Mxfp4Weight) else w2.data_ptr(),
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
            w13.scales.data_ptr() if isinstance(w13, Mxfp4Weight) else 0,
            w2.scales.data_ptr() if isinstance(w2, Mxfp4Weight) else 0,
            0 if b13 is None else b13.data_ptr(),
            0 if b2 is None else b2.data_ptr(),
            ACTIVATION_CODES[activation],
            int(isinstance(w13, torch.Tensor) and w13.dtype == torch.bfloat16),
        )
        status = self._experts(args)
        if status == -2:
            raise ValueError(f"expert ids must lie in [0, {num_experts})")
        if status != 0:
            raise MemoryError("the CPU experts found no scratch memory")
        return out.to(hidden.dtype)


class CpuMoeRouter:
    """The library's router (``asyncstep_moe_route``): each row's top k
    experts of its float32 logits, as
    :func:`~asyncstep.ops.torch_moe.select_experts` defines them (the
    softmax, sigmoid or softmax of the top k logits; ties to the lower
    expert id; renormalised where asked), its sums in a fixed order (every
    build the same bits; torch's vectorized softmax rounds apart by an ulp
    or so). The CPU op set's router, and the float32 stack's
    (:mod:`~asyncstep.ops.cpu.f32_stack`), so the two agree bit for bit."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._route = library.asyncstep_moe_route
        self._route.argtypes = [ctypes.c_char_p]
        self._route.restype = ctypes.c_int

    @staticmethod
    def applies(router_logits: torch.Tensor, top_k: int, scoring_func: str) -> bool:
        """Whether the call takes these: 2-D CPU logits (any float dtype,
        read as float32) of at most 4096 experts, 1 <= top_k <= experts, a
        scoring it computes."""
        return (
            router_logits.dim() == 2
            and router_logits.device.type == "cpu"
            and router_logits.is_floating_point()
            and 1 <= top_k <= router_logits.shape[1] <= 4096
            and scoring_func in SCORING_CODES
        )

    def __call__(
        self,
        router_logits: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        scoring_func: str = "softmax",
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights [T, k] float32, topk_ids [T, k] int32)``; each
        pair's expert added to ``counts`` (int64 ``[E]``) where given."""
        if not self.applies(router_logits, top_k, scoring_func):
            raise ValueError(
                "the CPU router takes 2-D float CPU logits of <= 4096 experts, "
                f"1 <= top_k <= experts and a scoring of {sorted(SCORING_CODES)}"
            )
        logits = router_logits.float()
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        tokens, experts = logits.shape
        if counts is not None and (
            counts.dtype != torch.int64 or counts.shape != (experts,) or not counts.is_contiguous()
        ):
            raise ValueError(f"counts must be contiguous int64 [{experts}]")
        ids = torch.empty(tokens, top_k, dtype=torch.int32)
        weights = torch.empty(tokens, top_k, dtype=torch.float32)
        args = _ROUTE_ARGS.pack(
            logits.data_ptr(),
            logits.stride(0),
            tokens,
            experts,
            top_k,
            SCORING_CODES[scoring_func],
            int(renormalize),
            ids.data_ptr(),
            weights.data_ptr(),
            0 if counts is None else counts.data_ptr(),
        )
        if self._route(args) != 0:
            raise ValueError("the CPU router refused its arguments")
        return weights, ids


def _bias(bias: torch.Tensor | None, shape: tuple[int, ...], name: str) -> torch.Tensor | None:
    """A bias as the C side reads it (float32, contiguous), its shape checked."""
    if bias is None:
        return None
    if tuple(bias.shape) != shape:
        raise ValueError(f"{name} bias {tuple(bias.shape)} does not match the experts' {shape}")
    return bias.float().contiguous()


@functools.cache
def moe_experts() -> CpuMoeExperts | None:
    """The library's grouped experts (the library built on first use); None
    where the library is off or does not build."""
    kernels = load_cpu_kernels()
    return None if kernels is None else CpuMoeExperts(kernels.library)


@functools.cache
def moe_router() -> CpuMoeRouter | None:
    """The library's router; None where the library is off or does not build."""
    kernels = load_cpu_kernels()
    return None if kernels is None else CpuMoeRouter(kernels.library)
