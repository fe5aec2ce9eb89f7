"""The MoE tiny model's library calls one at a time (float32 matmul,
router, experts; torch's F.linear beside the matmul): ms and GFLOP/s.

    PYTHONPATH=. python3 ops_gflops.py 16 256 2048
"""

import sys
import time
from collections.abc import Callable

import torch

from asyncstep.ops.cpu.dense_f32 import dense_f32_matmul
from asyncstep.ops.cpu.moe import moe_experts, moe_router

H = 512


def bench(name: str, fn: Callable[[], object], flop: float, n: int = 5) -> None:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    seconds = (time.perf_counter() - start) / n
    print(f"{name:34s} {seconds * 1e3:8.2f} ms  {flop / seconds / 1e9:6.1f} GFLOP/s")


def main() -> None:
    torch.manual_seed(0)
    mm, experts, router = dense_f32_matmul(), moe_experts(), moe_router()
    assert mm is not None and experts is not None and router is not None
    linear = torch.nn.functional.linear
    for t in (int(a) for a in sys.argv[1:]):
        x = torch.randn(t, H)
        w_qkv, w_o, w_head = torch.randn(1024, H), torch.randn(512, 512), torch.randn(32768, H)
        reps = max(3, 2000 // t)
        bench(f"T={t} qkv 1024x512", lambda: mm(x, w_qkv), 2 * t * 1024 * H, reps)  # noqa: B023
        bench(f"T={t} qkv 1024x512 torch", lambda: linear(x, w_qkv), 2 * t * 1024 * H, reps)  # noqa: B023
        bench(f"T={t} o 512x512", lambda: mm(x, w_o), 2 * t * 512 * H, reps)  # noqa: B023
        if t <= 64:
            bench(f"T={t} lm head", lambda: mm(x, w_head), 2 * t * 32768 * H)  # noqa: B023
            bench(f"T={t} lm head torch", lambda: linear(x, w_head), 2 * t * 32768 * H)  # noqa: B023
        w13, w2 = torch.randn(32, 512, H) * 0.05, torch.randn(32, H, 256) * 0.05
        weights, ids = router(torch.randn(t, 32), 4, renormalize=True)
        flop = 2 * t * 4 * 3 * H * 256
        bench(
            f"T={t} experts",
            lambda: experts(x, w13, w2, weights, ids),  # noqa: B023
            flop,
            max(3, 500 // t),
        )


if __name__ == "__main__":
    main()
