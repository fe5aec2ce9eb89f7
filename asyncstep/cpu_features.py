"""What this machine's CPU can do, read from its feature flags
(``/proc/cpuinfo``) without torch or a compiler: whether it multiplies
bfloat16 natively, and whether the CPU library's quantized matmuls have a
vector build for it. Imports the standard library only."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

__all__ = ["cpu_flags", "cpu_has_bf16", "cpu_has_quant_vectors"]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86's ``flags``, Arm's ``Features``)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset(platform.processor().split())


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX), as
    vLLM's CPU backend decides."""
    return not {"avx512_bf16", "amx_tile"}.isdisjoint(cpu_flags())


def cpu_has_quant_vectors() -> bool:
    """Whether this CPU has the vector instructions the library's quantized
    matmuls are built for: AVX512-VNNI with AVX512-BW, or AVX2 with FMA and
    F16C."""
    flags = cpu_flags()
    return {"avx512_vnni", "avx512bw"} <= flags or {"avx2", "fma", "f16c"} <= flags
