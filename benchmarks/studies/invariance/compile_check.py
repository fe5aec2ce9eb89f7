"""The invariant matmul compiled for Hopper (sm_90) without a GPU, with the
ptxas of triton's wheel: for each launch (the split programs, a program per
tile) and dtype, the MMA instructions, the shared memory, the asynchronous
copies (a pipelined K loop) and the arrival atomic. Exit status 1 if the
two launches' 16-bit MMA instructions differ (the same instruction for
every M is what makes the launch choice bit-neutral) or a 16-bit launch is
not pipelined. The arguments are specialised as a launch on contiguous,
16-byte aligned tensors would be (unit K strides, divisible sizes).

    python3 benchmarks/studies/invariance/compile_check.py
"""

from __future__ import annotations

import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from asyncstep.ops.triton import invariant_matmul as inv

NAMES = [
    "x_ptr",
    "w_ptr",
    "out_ptr",
    "part_ptr",
    "count_ptr",
    "M",
    "N",
    "K",
    "K_SPLIT",
    "SPLITS",
    "stride_xm",
    "stride_xk",
    "stride_wn",
    "stride_wk",
    "stride_om",
    "stride_on",
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "PARALLEL",
    "DOT_PRECISION",
    "PDL",
]
DIVISIBLE = ["x_ptr", "w_ptr", "out_ptr", "part_ptr", "count_ptr", "N", "K", "K_SPLIT"]
DIVISIBLE += ["stride_xm", "stride_wn", "stride_om"]


def compile_ptx(parallel: bool, dtype: str, out: str) -> tuple[str, int]:
    """The PTX and the shared memory bytes of one launch."""
    t = inv.TILE
    consts: dict[str, object] = {
        "stride_xk": 1,
        "stride_wk": 1,
        "stride_on": 1,
        "BLOCK_M": t.block_m,
        "BLOCK_N": t.block_n,
        "BLOCK_K": t.block_k,
        "PARALLEL": parallel,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "PDL": True,
    }
    ptrs = {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": out, "part_ptr": "fp32", "count_ptr": "i32"}
    signature = {
        n: f"*{ptrs[n]}" if n in ptrs else "constexpr" if n in consts else "i32" for n in NAMES
    }
    attrs = {(NAMES.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    src = ASTSource(
        fn=inv._invariant_matmul_kernel, signature=signature, constexprs=consts, attrs=attrs
    )
    stages = t.split_stages if parallel else t.num_stages
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": t.num_warps, "num_stages": stages},
    )
    return compiled.asm["ptx"], int(compiled.metadata.shared)


def main() -> int:
    ok = True
    for dtype, out in (("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"), ("fp32", "fp32")):
        mmas = {}
        for parallel in (True, False):
            ptx, shared = compile_ptx(parallel, dtype, out)
            mma = sorted(set(re.findall(r"wgmma\.mma_async[\w.]*", ptx)))
            copies = len(re.findall(r"cp\.async\.c[ag]", ptx))
            atom = [line.strip() for line in ptx.splitlines() if "atom." in line]
            mmas[parallel] = mma
            launch = "split programs" if parallel else "per tile"
            print(
                f"{dtype}->{out} {launch:14}: {mma or 'no wgmma (FMA dot)'}, shared {shared} B, "
                f"cp.async {copies}, atomics {atom}",
                flush=True,
            )
            if dtype != "fp32" and (not mma or copies == 0):
                ok = False
        if mmas[True] != mmas[False]:
            print(f"{dtype}: the launches' MMA instructions DIFFER")
            ok = False
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
