"""Which kernels a model runs, chosen once per model: the attention backend
and the op set.

Attention: ``auto`` is Triton on CUDA (when installed), the CPU library's
kernel on the CPU where it builds for the dtype, else the torch reference
(which plans decodes on the host: no FULL CUDA graph over it). The op set:
the Triton kernels where attention is Triton and the fused kernels are on,
the CPU library's where the device is the CPU, the fused kernels are on and
the library loads, else the reference.

May import torch, :mod:`asyncstep.errors` and :mod:`asyncstep.ops`.
"""

from __future__ import annotations

import importlib.util

import torch

from asyncstep.errors import ConfigError
from asyncstep.ops.base import OpSet
from asyncstep.ops.cpu.library import cpu_attention_supported, load_cpu_kernels
from asyncstep.ops.torch_ref import TORCH_OPS

__all__ = ["resolve_attention_backend", "select_ops", "triton_available"]

ATTENTION_BACKENDS = ("torch", "triton", "cpu")


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


def select_ops(device: torch.device, attention_backend: str, *, fused_kernels: bool) -> OpSet:
    """The op set for a model on ``device`` whose attention runs
    ``attention_backend`` (resolved); ``fused_kernels`` off: the reference."""
    if fused_kernels and attention_backend == "triton":
        from asyncstep.ops.triton import TritonOps

        return TritonOps()
    if fused_kernels and device.type == "cpu":
        kernels = load_cpu_kernels()
        if kernels is not None:
            from asyncstep.ops.cpu.ops import CpuOps

            return CpuOps(kernels.layer_ops)
    return TORCH_OPS
