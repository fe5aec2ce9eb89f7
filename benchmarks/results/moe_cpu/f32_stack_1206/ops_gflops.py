"""The MoE tiny model's library calls one at a time (float32 matmul,
router, experts; torch's F.linear beside the matmul): ms and GFLOP/s.
    PYTHONPATH=. python3 ops_gflops.py 16 256 2048
"""
import time, torch, sys
from asyncstep.ops.cpu.dense_f32 import dense_f32_matmul
from asyncstep.ops.cpu.moe import moe_experts, moe_router
torch.manual_seed(0)
mm = dense_f32_matmul(); ex = moe_experts(); ro = moe_router()
H=512
def bench(name, fn, flop, n=5):
    fn()
    t=time.perf_counter()
    for _ in range(n): fn()
    d=(time.perf_counter()-t)/n
    print(f"{name:34s} {d*1e3:8.2f} ms  {flop/d/1e9:6.1f} GFLOP/s")
for T in (int(a) for a in sys.argv[1:]):
    x = torch.randn(T, H)
    W = torch.randn(1024, H); Wo = torch.randn(512, 512); Wlm = torch.randn(32768, H)
    bench(f"T={T} qkv 1024x512", lambda: mm(x, W), 2*T*1024*H, n=max(3, 2000//T))
    bench(f"T={T} qkv 1024x512 torch", lambda: torch.nn.functional.linear(x, W), 2*T*1024*H, n=max(3, 2000//T))
    bench(f"T={T} o 512x512", lambda: mm(x, Wo), 2*T*512*H, n=max(3, 2000//T))
    if T <= 64:
        bench(f"T={T} lm head", lambda: mm(x, Wlm), 2*T*32768*H)
        bench(f"T={T} lm head torch", lambda: torch.nn.functional.linear(x, Wlm), 2*T*32768*H)
    w13 = torch.randn(32, 512, H)*0.05; w2 = torch.randn(32, H, 256)*0.05
    w, ids = ro(torch.randn(T, 32), 4, renormalize=True)
    bench(f"T={T} experts", lambda: ex(x, w13, w2, w, ids), 2*T*4*3*H*256, n=max(3, 500//T))
