"""``cpu_precision.py`` with some projections' activations at one int8
level (the others two): a variant's ``"_one"`` names them (comma-separated:
``qkv``, ``o``, ``gate_up``, ``down``), set on every layer's packed weight
before the decoder stack is built. Its engine runs in this process
(``"engine_process": false``), where the patch applies.

    python3 benchmarks/studies/cpu_precision/one_level.py '{"engine_process": false}' \\
        '{"engine_process": false, "_one": "gate_up"}' \\
        --out benchmarks/results/cpu/q4m_1205/precision_one_level.json
"""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import asyncstep
from asyncstep.ops.cpu import decode_stack

ONE: set[str] = set()
_build = decode_stack.CpuDecodeStack.build.__func__  # type: ignore[attr-defined]
_open_engine = asyncstep.open_engine


def build(cls: Any, kernels: Any, layers: list[Any]) -> Any:
    for layer in layers:
        projections = {
            "qkv": layer.self_attn.qkv_proj,
            "o": layer.self_attn.o_proj,
            "gate_up": layer.mlp.gate_up_proj,
            "down": layer.mlp.down_proj,
        }
        for name, module in projections.items():
            if module.packed is not None and hasattr(module.packed, "levels"):
                module.packed.levels = 1 if name in ONE else 2
    return _build(cls, kernels, layers)


def open_engine(*args: Any, **options: Any) -> Any:
    one = options.pop("_one", None)
    ONE.clear()
    ONE.update(one.split(",") if one else ())
    return _open_engine(*args, **options)


if __name__ == "__main__":
    decode_stack.CpuDecodeStack.build = classmethod(build)  # type: ignore[method-assign,assignment]
    asyncstep.open_engine = open_engine  # type: ignore[assignment]
    runpy.run_path(str(Path(__file__).with_name("cpu_precision.py")), run_name="__main__")
