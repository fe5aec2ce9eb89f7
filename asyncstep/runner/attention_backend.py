"""Which attention backend and CUDA-graph mode a runner can use.

The torch reference plans decodes on the host (dynamic shapes), so it
cannot run inside a FULL graph; the Triton kernels read only device
metadata and can. On the CPU the compiled kernel (``cpu``) replaces the
reference where it builds. CUDA graphs need CUDA (or the CPU stand-in, for
tests).
"""

from __future__ import annotations

import importlib.util

import structlog
import torch

from asyncstep.errors import ConfigError
from asyncstep.models.layers.cpu_kernels import cpu_attention_supported
from asyncstep.runner.cudagraph_dispatcher import CUDAGraphMode

__all__ = ["resolve_attention_backend", "resolve_cudagraph_mode", "triton_available"]

log = structlog.get_logger(__name__)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: Triton on CUDA (when installed); on the CPU the CPU kernel
    where it builds for ``dtype``; else the torch reference."""
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
    if name not in ("torch", "triton", "cpu"):
        raise ConfigError(f"attention_backend must be auto, torch, cpu or triton, got {name!r}")
    return name


def resolve_cudagraph_mode(
    name: str, device: torch.device, backend: str, stand_in: bool = False
) -> CUDAGraphMode:
    """The configured mode, as far as the device and backend allow: NONE
    without CUDA (unless ``stand_in``); FULL graphs only with Triton
    attention (else their batches run PIECEWISE, or eagerly)."""
    mode = CUDAGraphMode.parse(name)
    if device.type != "cuda" and not stand_in:
        return CUDAGraphMode.NONE
    if backend == "triton" or not mode.has_full_cudagraphs():
        return mode
    fallback = {
        CUDAGraphMode.FULL: CUDAGraphMode.PIECEWISE,
        CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.PIECEWISE,
        CUDAGraphMode.FULL_DECODE_ONLY: CUDAGraphMode.NONE,
    }[mode]
    log.warning(
        "FULL CUDA graphs need the triton attention backend",
        cudagraph_mode=mode.name,
        using=fallback.name,
    )
    return fallback
