"""Which kernels a model runs, chosen once per model: the attention backend
and the op set.

Attention: ``auto`` is Triton on CUDA (when installed), the CPU library's
kernel on the CPU where it builds for the dtype, else the torch reference
(which plans decodes on the host: no FULL CUDA graph over it); each
backend's op is one line of :data:`ATTENTION_OPS`. The op set: the Triton
kernels where attention is Triton and the fused kernels are on (the KV
store then rotates q and k, and with ``fused_decode`` a decode batch's
attention too), the CPU library's where the device is the CPU, the fused
kernels are on and the library loads, else the reference's layer ops (on
the CPU with its float32 LM head); each
with the backend's attention op. ``batch_invariant`` (None: the device's
default, :data:`BATCH_INVARIANT_DEFAULT`; on CUDA for models of dense
16-bit weights without experts, with the Triton attention and fused
kernels, on the GPUs of :data:`CUDA_INVARIANT_DEVICES`): on CUDA the Triton
batch-invariant op set with its own attention (asked for: ConfigError
without triton or with another attention backend); on the CPU the choice
above, whose packed weights are batch-invariant already, and whose dense
bfloat16 weights (a MoE model's experts too) go through the library's
invariant matmul when asked for, or by default where that matmul's build is
a blocked one (``CpuDenseMatmul.fast``: AVX512-BF16, AVX512F, AVX2; not
plain C, which computes a row at a time); dense float32 weights and the
float32 LM head likewise through the library's float32 matmul
(``CpuDenseF32Matmul.fast``: AVX-512, AVX2; not plain C).

:func:`cpu_mxfp4_experts_available`: whether the CPU library's experts,
which compute on MXFP4 weights kept packed, build here (a model keeps its
MXFP4 experts packed only then).

May import torch, :mod:`asyncstep.errors` and :mod:`asyncstep.ops`.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from asyncstep.errors import ConfigError
from asyncstep.ops.base import AttentionOp, OpSet
from asyncstep.ops.cpu.library import cpu_attention_supported, load_cpu_kernels
from asyncstep.ops.torch_attention import TORCH_ATTENTION
from asyncstep.ops.torch_ref import TORCH_OPS, TorchOps

__all__ = [
    "BATCH_INVARIANT_DEFAULT",
    "CUDA_INVARIANT_DEVICES",
    "attention_op",
    "measured_cuda_device",
    "resolve_attention_backend",
    "resolve_batch_invariant",
    "select_ops",
    "triton_available",
]

#: Each attention backend's op: ``module:class``, imported when chosen
#: (triton is optional); the class's ``chosen(fused_kernels=...,
#: fused_decode=...)`` makes it.
ATTENTION_OPS = {
    "torch": "asyncstep.ops.torch_attention:TorchAttention",
    "triton": "asyncstep.ops.triton.paged_attention:TritonAttention",
    "cpu": "asyncstep.ops.cpu.paged_attention:CpuAttention",
}
ATTENTION_BACKENDS = tuple(ATTENTION_OPS)


#: ``batch_invariant=None`` by device type: the CPU's kernels are invariant
#: (dense bfloat16 where the library's build is a blocked one); on CUDA the
#: invariant op set, where :func:`resolve_batch_invariant` finds it fits the
#: model and the GPU is one of :data:`CUDA_INVARIANT_DEVICES`. Types not
#: listed: off.
BATCH_INVARIANT_DEFAULT = {"cpu": True, "cuda": True}
#: The GPUs (by name) where the invariant op set's measured cost is within
#: 10 %: llama-8b's ITL at batch 1 and 32, its TTFT, llama-1b's throughput
#: (docs/performance.md, "Batch invariance"). Measured over it: the H200
#: (ITL x1.16 at batch 1). Others: not measured, off.
CUDA_INVARIANT_DEVICES = frozenset({"NVIDIA H100 80GB HBM3"})


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The attention backend for ``name`` (``auto`` or one of
    :data:`ATTENTION_BACKENDS`) on ``device`` in ``dtype``; ConfigError
    where it cannot run."""
    if name == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if device.type == "cpu" and cpu_attention_supported(dtype) else "torch"
    if name == "triton" and not triton_available():
        raise ConfigError("attention_backend='triton' needs triton (pip install triton)")
    if name == "cpu" and not (device.type == "cpu" and cpu_attention_supported(dtype)):
        raise ConfigError(
            f"attention_backend='cpu' needs a CPU device, float32 or bfloat16 (got {dtype}) "
            "and a C compiler"
        )
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend must be auto, torch, cpu or triton, got {name!r}")
    return name


def attention_op(backend: str, *, fused_kernels: bool, fused_decode: bool) -> AttentionOp:
    """The attention op of ``backend`` (resolved: one of :data:`ATTENTION_OPS`)."""
    module, _, name = ATTENTION_OPS[backend].partition(":")
    op: AttentionOp = getattr(importlib.import_module(module), name).chosen(
        fused_kernels=fused_kernels, fused_decode=fused_decode
    )
    return op


def resolve_batch_invariant(
    batch_invariant: bool | None, device: torch.device, *, fits_cuda_default: bool = True
) -> bool:
    """``batch_invariant`` on ``device``; None: :data:`BATCH_INVARIANT_DEFAULT`,
    on CUDA only where ``fits_cuda_default`` and the GPU is one of
    :data:`CUDA_INVARIANT_DEVICES`. ``fits_cuda_default``: the Triton
    attention backend and fused kernels (not asked away), triton installed,
    and a model of dense 16-bit weights without experts (the invariant op
    set reads no packed Q4 / Q8 copy, so a packed model would lose its
    GEMVs; no figure covers its experts' cost yet)."""
    if batch_invariant is not None:
        return batch_invariant
    if not BATCH_INVARIANT_DEFAULT.get(device.type, False):
        return False
    return device.type != "cuda" or (fits_cuda_default and measured_cuda_device(device))


def measured_cuda_device(device: torch.device) -> bool:
    """Whether ``device`` is a GPU of :data:`CUDA_INVARIANT_DEVICES`."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_name(device) in CUDA_INVARIANT_DEVICES


def select_ops(
    device: torch.device,
    attention_backend: str,
    *,
    fused_kernels: bool,
    fused_decode: bool = False,
    int8_activations: bool = False,
    batch_invariant: bool | None = None,
    dense_16_bit: bool = True,
) -> OpSet:
    """The op set for a model on ``device`` whose attention runs
    ``attention_backend`` (resolved); ``fused_kernels`` off: the reference's
    layer ops (beside the backend's attention; on the CPU with the CPU's
    float32 LM head, :class:`~asyncstep.ops.cpu.ops.CpuHeadOps`); ``fused_decode``: the
    Triton op set's one-row matmuls and decode attention; ``int8_activations``:
    its Q4 / Q8 GEMVs quantize 16-bit x to int8 (``gpu_q4_activations``);
    ``batch_invariant`` on CUDA: the Triton batch-invariant op set, whatever
    ``fused_kernels`` and ``fused_decode`` say; None: the device's default
    (:func:`resolve_batch_invariant`; ``dense_16_bit``: the model's weights
    are dense 16-bit ones, without experts)."""
    fits = dense_16_bit and fused_kernels and attention_backend == "triton" and triton_available()
    if device.type == "cuda" and resolve_batch_invariant(
        batch_invariant, device, fits_cuda_default=fits
    ):
        return _invariant_ops(attention_backend)
    attention = attention_op(
        attention_backend, fused_kernels=fused_kernels, fused_decode=fused_decode
    )
    if fused_kernels and attention_backend == "triton":
        from asyncstep.ops.triton import TritonOps

        return TritonOps(attention, fused_decode=fused_decode, int8_activations=int8_activations)
    if device.type == "cpu":
        from asyncstep.ops.cpu.ops import CpuHeadOps, CpuOps

        kernels = load_cpu_kernels() if fused_kernels else None
        if kernels is not None:
            dense = _cpu_dense_invariant(batch_invariant)
            float32 = _cpu_float32_invariant(batch_invariant)
            return CpuOps(
                kernels.layer_ops, attention, invariant_dense=dense, invariant_float32=float32
            )
        return CpuHeadOps(attention)
    return TORCH_OPS if attention is TORCH_ATTENTION else TorchOps(attention)


def _cpu_dense_invariant(batch_invariant: bool | None) -> bool:
    """Whether dense bfloat16 weights run the library's invariant matmul:
    ``batch_invariant`` if given, else where its build is a blocked one."""
    if batch_invariant is not None:
        return batch_invariant
    from asyncstep.ops.cpu.dense import dense_matmul

    matmul = dense_matmul()
    return matmul is not None and matmul.fast


def _cpu_float32_invariant(batch_invariant: bool | None) -> bool:
    """Whether dense float32 weights and the float32 LM head run the
    library's invariant float32 matmul: ``batch_invariant`` if given, else
    where its build is a blocked one."""
    if batch_invariant is not None:
        return batch_invariant
    from asyncstep.ops.cpu.dense_f32 import dense_f32_matmul

    matmul = dense_f32_matmul()
    return matmul is not None and matmul.fast


def _invariant_ops(attention_backend: str) -> OpSet:
    """The Triton batch-invariant op set; ConfigError where it cannot run."""
    if not triton_available():
        raise ConfigError("batch_invariant on CUDA needs triton (pip install triton)")
    if attention_backend != "triton":
        raise ConfigError(
            f"batch_invariant on CUDA runs the triton attention backend, not {attention_backend!r}"
        )
    from asyncstep.ops.triton.invariant_ops import TritonInvariantOps

    return TritonInvariantOps()


def cpu_mxfp4_experts_available() -> bool:
    """Whether the CPU library's grouped experts (MXFP4 weights too) load here."""
    from asyncstep.ops.cpu.moe import moe_experts

    return moe_experts() is not None
