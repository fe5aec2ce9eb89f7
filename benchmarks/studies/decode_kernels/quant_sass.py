"""The Q4 / Q8 GEMV's machine code, without a GPU: compile
``asyncstep.ops.triton.quant``'s GEMV for sm_90 (Triton's own ptxas), and
count the SASS instructions of its main loop per weight, by opcode.

    python3 benchmarks/studies/decode_kernels/quant_sass.py [--out DIR] \\
        [BITS,BLOCK_N,BLOCK_G,WARPS[,STAGES[,INT8]] ...]

With ``--out``, each launch's SASS, PTX and TTGIR go there. Integer
arguments are specialized as divisible by 16, as Triton's launcher does for
llama's shapes.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from asyncstep.ops.triton import quant as tq

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
DEFAULT = ["4,8,64,2", "4,8,64,2,1,1", "8,8,32,2", "8,8,32,2,1,1"]


def compile_gemv(
    bits: int, block_n: int, block_g: int, warps: int, stages: int, int8: bool = False
) -> object:
    """The GEMV compiled for sm_90 with bfloat16 x, one row, unmasked tiles
    (prefetch in registers with one stage); ``int8``: x quantized to int8
    and ``dp4a`` (inline PTX)."""
    sig = {
        "x_ptr": "*bf16",
        "qw_ptr": "*i32",
        "sm_ptr": "*i32",
        "out_ptr": "*bf16",
        **dict.fromkeys(["nw_ptr", "sq_ptr", "res_ptr", "next_nw_ptr", "xw_ptr"], "*bf16"),
        "sq_out_ptr": "*fp32",
        "M": "i32",
        "N": "i32",
        "K_GROUPS": "i32",
        **dict.fromkeys(["stride_xm", "stride_om", "stride_sq", "stride_rm", "stride_xwm"], "i32"),
        "stride_sqo": "i32",
        "n_sq_parts": "i32",
        "eps": "fp32",
    }
    consts = {
        "BITS": bits,
        "BLOCK_M": 1,
        "BLOCK_N": block_n,
        "BLOCK_G": block_g,
        "PREFETCH": stages == 1,
        "EVEN": True,
        "STAGES": stages,
        "PROLOGUE": 0,
        "SQ_BLOCK": 1,
        "RESIDUAL": False,
        "SILU_PAIRS": False,
        "NEXT_NORM": False,
        "INT8": int8,
        "ASM": int8,
        "PDL": False,
    }
    divisible = [
        (i,)
        for i, name in enumerate(sig)
        if name.endswith("_ptr") or name not in ("M", "n_sq_parts", "eps")
    ]
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {index: [["tt.divisibility", 16]] for index in divisible}
    return triton.compile(
        ASTSource(tq._gemv_kernel, sig, consts, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's span (the K loop)."""
    instrs = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(2)))
    best: list[str] = []
    for addr, ins in instrs:
        target = re.search(r"BRA.*0x([0-9a-f]+)", ins)
        if target and int(target.group(1), 16) < addr:
            span = [i for a, i in instrs if int(target.group(1), 16) <= a <= addr]
            best = max(best, span, key=len)
    return best


def opcode(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("launches", nargs="*", default=DEFAULT)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90")
    for launch in args.launches:
        bits, block_n, block_g, warps, stages, int8 = (
            int(v) for v in (launch + ",1,0").split(",")[:6]
        )
        kernel = compile_gemv(bits, block_n, block_g, warps, stages, bool(int8))
        tag = f"q{bits}_n{block_n}_g{block_g}_w{warps}_s{stages}" + ("_int8" if int8 else "")
        out = args.out or Path("/tmp")
        out.mkdir(parents=True, exist_ok=True)
        cubin = out / f"{tag}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])  # type: ignore[attr-defined]
        sass = subprocess.run(
            [str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True
        ).stdout
        usage = subprocess.run(
            [str(BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True
        ).stdout
        if args.out:
            (out / f"{tag}.sass").write_text(sass)
        else:
            cubin.unlink()
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        loop = main_loop(sass)
        per_thread = block_n * block_g * 32 / (32 * warps)
        ops = collections.Counter(opcode(i) for i in loop)
        print(
            f"{tag}: {regs.group(1) if regs else '?'} registers, stack "
            f"{stack.group(1) if stack else '?'}; loop {len(loop)} instructions for "
            f"{per_thread:.0f} weights a thread: {len(loop) / per_thread:.2f} a weight; "
            + ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
