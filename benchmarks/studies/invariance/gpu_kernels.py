"""The batch-invariant kernels against the fast ones, kernel by kernel
(issue 40): the fixed-tile matmul against ``F.linear`` (cuBLAS) on
llama-8b's linear shapes at 1, 32, 512 and 2048 rows; the fixed-split
attention (at 64, 128 and 256 keys a split) against the Triton split-KV /
query-tiled kernels for decode batches of 1 and 32 at 192, 1024 and 4096
keys, and one 2048-token prompt.
Median times (``triton.testing.do_bench``) and the ratio, one line each.

    python3 benchmarks/studies/invariance/gpu_kernels.py
    python3 benchmarks/studies/invariance/gpu_kernels.py --device cpu --tiny  # a dry run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1 :][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch
import torch.nn.functional as F

from asyncstep.ops.triton import invariant_attention
from asyncstep.ops.triton.attention import paged_attention
from asyncstep.ops.triton.invariant_attention import SPLIT_KEYS, invariant_paged_attention
from asyncstep.ops.triton.invariant_matmul import invariant_matmul

#: llama-8b's (N, K): qkv, o, gate_up, down, the LM head.
LINEARS = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
TINY_LINEARS = [(96, 64), (64, 128)]
#: The invariant attention's keys per split tried (the default last; every
#: one a multiple of the key tiles).
SPLITS = (64, 128, SPLIT_KEYS)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of ``fn``."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def matmuls(device: torch.device, dtype: torch.dtype, tiny: bool) -> None:
    for n, k in TINY_LINEARS if tiny else LINEARS:
        w = torch.randn(n, k, device=device).to(dtype)
        for m in (1, 32) if tiny else (1, 32, 512, 2048):
            x = torch.randn(m, k, device=device).to(dtype)
            fast = timed(lambda x=x, w=w: F.linear(x, w), device)
            inv = timed(lambda x=x, w=w: invariant_matmul(x, w), device)
            print(
                f"matmul N={n:6} K={k:5} M={m:4}: F.linear {fast:8.4f} ms, "
                f"invariant {inv:8.4f} ms, x{inv / fast:5.2f}",
                flush=True,
            )


def attention(device: torch.device, dtype: torch.dtype, tiny: bool) -> None:
    heads, kv_heads, dim, block = (4, 2, 16, 16) if tiny else (32, 8, 128, 16)
    cases = [(1, 64, 1), (2, 100, 1)] if tiny else [(1, 192, 1), (32, 192, 1), (1, 1024, 1)]
    cases += [(1, 4096, 1), (32, 1024, 1), (32, 4096, 1), (1, 2048, 2048)] if not tiny else []
    cases += [(1, 40, 40)] if tiny else []
    for reqs, keys, q_len in cases:
        blocks_per = -(-keys // block)
        cache = torch.randn(2, kv_heads, reqs * blocks_per, block, dim, device=device).to(dtype)
        table = torch.arange(reqs * blocks_per, dtype=torch.int32, device=device)
        table = table.view(reqs, blocks_per)
        q = torch.randn(reqs * q_len, heads, dim, device=device).to(dtype)
        qsl = torch.arange(0, reqs * q_len + 1, q_len, dtype=torch.int32, device=device)
        seq_lens = torch.full((reqs,), keys, dtype=torch.int32, device=device)
        args = (q, cache, qsl, seq_lens, table, dim**-0.5)
        fast = timed(lambda a=args, n=q_len: paged_attention(*a, max_query_len=n), device)
        cells = []
        for split in SPLITS:  # keys per split: each a fixed order (other bits)
            invariant_attention.SPLIT_KEYS = split
            inv = timed(lambda a=args: invariant_paged_attention(*a), device)
            cells.append(f"split {split}: {inv:8.4f} ms x{inv / fast:5.2f}")
        invariant_attention.SPLIT_KEYS = SPLIT_KEYS
        print(
            f"attention {reqs:2} x {q_len:4} queries over {keys:5} keys: Triton {fast:8.4f} ms, "
            "invariant " + ", ".join(cells),
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a dry run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, "float32" if device.type == "cpu" else args.dtype)
    print(f"device={device} dtype={dtype}", flush=True)
    matmuls(device, dtype, args.tiny)
    attention(device, dtype, args.tiny)
