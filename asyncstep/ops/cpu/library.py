"""The CPU's compiled kernels: ``cpu_kernels.c`` compiled on first use with
the machine's C compiler, cached, and called through ctypes. One library
holds the paged attention (:mod:`~asyncstep.ops.cpu.attention`),
a decoder layer's non-matmul ops
(:mod:`~asyncstep.ops.cpu.layer_ops`), the matmuls of weights
kept quantized (``cpu_quant.c``, bound by
:func:`~asyncstep.ops.cpu.quant.quant_matmul`) and of dense
bfloat16 weights with float32 outputs (``cpu_dense.c``, bound by
:func:`~asyncstep.ops.cpu.dense.dense_matmul`) and of dense float32 weights
(``cpu_dense_f32.c``, bound by
:func:`~asyncstep.ops.cpu.dense_f32.dense_f32_matmul`) and a mixture-of-experts
layer's float32 experts (``cpu_moe.c``, bound by
:func:`~asyncstep.ops.cpu.moe.moe_experts`) and its router
(``cpu_moe_router.c``, :func:`~asyncstep.ops.cpu.moe.moe_router`).

The shared library is built for this CPU (``-march=native``; with
``ASYNCSTEP_CPU_KERNELS_ISA=avx2`` for AVX2 + FMA + F16C only, the build a
CPU without AVX-512 runs: to test or time that build on a newer CPU) into
``$ASYNCSTEP_CACHE_DIR`` (default ``$XDG_CACHE_HOME/asyncstep`` or
``~/.cache/asyncstep``), keyed by the source, the flags and the CPU's
feature flags, so later processes load it without compiling; the build,
a wait of seconds once per machine, is told on stderr
(:func:`~asyncstep.logging.notice`). Without a
compiler (or with ``ASYNCSTEP_CPU_KERNELS=torch``; the older
``ASYNCSTEP_CPU_ATTENTION=torch`` too) :func:`load_cpu_kernels` returns None
and every caller runs torch instead: the runner keeps the torch reference
attention, the norms and the MLP their torch expressions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from asyncstep.cpu_features import cpu_flags
from asyncstep.logging import notice, shown_path
from asyncstep.ops.cpu.attention import CPU_ATTENTION_DTYPES, CpuPagedAttention
from asyncstep.ops.cpu.layer_ops import CpuLayerOps

__all__ = [
    "CpuKernels",
    "cpu_attention_supported",
    "cpu_kernels_off",
    "load_cpu_kernels",
]

log = structlog.get_logger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / name
    for name in (
        "cpu_kernels.c",
        "cpu_quant.c",
        "cpu_decode.c",
        "cpu_dense.c",
        "cpu_moe.c",
        "cpu_moe_router.c",
        "cpu_dense_f32.c",
        "cpu_f32_stack.c",
    )
)
#: Included by the sources (part of the build key).
HEADERS = tuple(
    _HERE / name for name in ("cpu_common.h", "cpu_kernels.h", "cpu_quant.h", "cpu_f32.h")
)
#: Must match ``ASYNCSTEP_ABI_VERSION`` in the source.
ABI_VERSION = 6
#: Environment variables: ``torch`` turns the library off (torch runs instead).
SWITCH_ENVS = ("ASYNCSTEP_CPU_KERNELS", "ASYNCSTEP_CPU_ATTENTION")
CACHE_ENV = "ASYNCSTEP_CACHE_DIR"
#: Environment variable: the ISA the library is built for (:data:`ISA_FLAGS`).
ISA_ENV = "ASYNCSTEP_CPU_KERNELS_ISA"
#: The compiler's target flags per ISA: ``native`` (the default) this CPU's,
#: ``avx2`` a CPU with AVX2 + FMA + F16C only (CI's).
ISA_FLAGS = {"native": ("-march=native",), "avx2": ("-mavx2", "-mfma", "-mf16c")}
#: Tried in order; the first that builds is used (without OpenMP: one thread).
FLAG_SETS = (
    ("-fopenmp",),
    (),
)
BASE_FLAGS = (
    "-O3",
    "-std=gnu11",
    "-fPIC",
    "-shared",
    # Reassociation lets the dot products and sums vectorize; no finite-math
    # assumption (the softmax starts from -FLT_MAX, NaNs propagate).
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
)
#: Linked after the source (the layer ops call libm's expf).
LIBS = ("-lm",)


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library: where it lies, and its kernels."""

    path: Path
    library: ctypes.CDLL
    attention: CpuPagedAttention
    layer_ops: CpuLayerOps

    @classmethod
    def bind(cls, library: ctypes.CDLL, path: Path) -> CpuKernels:
        return cls(
            path,
            library,
            CpuPagedAttention(library, path),
            CpuLayerOps(library),
        )


def cpu_attention_supported(dtype: torch.dtype) -> bool:
    """Whether the attention kernel runs ``dtype`` here (and the library builds or loads)."""
    return dtype in CPU_ATTENTION_DTYPES and load_cpu_kernels() is not None


@functools.cache
def load_cpu_kernels() -> CpuKernels | None:
    """The library, built on first use (once per machine: cached); None when
    switched off or when no compiler builds it (logged once)."""
    if cpu_kernels_off():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler: the CPU kernels are off", compiler="cc")
        return None
    errors: list[str] = []
    for openmp in FLAG_SETS:
        flags = (*_isa_flags(), *openmp)
        target = _cache_dir() / f"cpu_kernels_{_build_key(compiler, flags)}.so"
        try:
            if not target.exists():
                if not errors:  # (a second flag set is the same wait, told once)
                    where = shown_path(target.parent)
                    notice(f"building the CPU kernels for this machine (once, ~10 s) in {where}")
                _compile(compiler, [*BASE_FLAGS, *flags], target)
            library = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(str(getattr(e, "stderr", "") or e)[-500:])
            continue
        if library.asyncstep_cpu_kernels_abi_version() != ABI_VERSION:
            errors.append(f"{target}: ABI version mismatch")
            continue
        if not openmp:
            log.warning("CPU kernels built without OpenMP: one thread", path=str(target))
        return CpuKernels.bind(library, target)
    log.warning("the CPU kernels do not build: they are off", errors=errors)
    return None


def cpu_kernels_off() -> bool:
    """Whether the environment switched the library off (torch runs instead)."""
    return any(os.environ.get(name) == "torch" for name in SWITCH_ENVS)


def _isa_flags() -> tuple[str, ...]:
    """The target flags :data:`ISA_ENV` asks for (unknown: native, logged)."""
    isa = os.environ.get(ISA_ENV, "native")
    if isa not in ISA_FLAGS:
        log.warning("unknown CPU kernel ISA: building for this CPU", isa=isa, known=list(ISA_FLAGS))
        isa = "native"
    return ISA_FLAGS[isa]


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "asyncstep")
    path = Path(root) / "kernels"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # not writable: build for this process only
        return Path(tempfile.mkdtemp(prefix="asyncstep-kernels-"))
    return path


def _build_key(compiler: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    for part in (compiler, *BASE_FLAGS, *flags, *LIBS, platform.machine(), *sorted(cpu_flags())):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    """Build into a temporary file, then rename: processes building at once
    (tensor-parallel ranks) never load a half-written library."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, *map(str, SOURCES), "-o", str(built), *LIBS],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        os.replace(built, target)
