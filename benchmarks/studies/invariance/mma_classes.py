"""Which tiles of the invariant matmul give the same bits, and which MMA
instructions they compile to (issue 40): llama-8b's qkv and down shapes,
M = 512, every tile of :data:`CONFIGS` launched as a program per tile;
the tiles grouped by bit-equal products, then each compiled variant's
count of Hopper ``wgmma`` and ``mma.sync`` instructions in its PTX.

    python3 benchmarks/studies/invariance/mma_classes.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout

from asyncstep.ops.triton import invariant_matmul as inv

#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages).
CONFIGS = [
    (64, 64, 128, 4, 3),
    (64, 64, 128, 8, 3),
    (64, 128, 128, 4, 4),
    (128, 64, 128, 4, 4),
    (128, 64, 128, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 128, 128, 4, 3),
    (64, 64, 64, 4, 3),
    (128, 128, 64, 8, 4),
    (64, 256, 128, 4, 2),
    (256, 128, 128, 8, 2),
]


def bit_classes(n: int, k: int) -> list[list[tuple[int, ...]]]:
    w = torch.randn(n, k, device="cuda").bfloat16()
    x = torch.randn(512, k, device="cuda").bfloat16()
    outs: dict[tuple[int, ...], torch.Tensor] = {}
    inv._PROMPT_TMA = False  # the pointer kernel: the tile alone changes
    for bm, bn, bk, warps, stages in CONFIGS:
        inv.PROMPT_TILES = ((1, inv.MatmulTile(bm, bn, bk, warps, stages, stages)),)
        outs[(bm, bn, bk, warps, stages)] = inv.invariant_matmul(x, w, parallel=False)
    classes: list[list[tuple[int, ...]]] = []
    for config, out in outs.items():
        same = [c for c in classes if torch.equal(outs[c[0]], out)]
        if same:
            same[0].append(config)
        else:
            classes.append([config])
    return classes


def main() -> int:
    torch.manual_seed(0)
    for n, k in ((6144, 4096), (4096, 14336)):
        print(f"N={n} K={k}: tiles by bit-equal products at M = 512")
        for group in bit_classes(n, k):
            print("  ", group)
    for caches in inv._invariant_matmul_kernel.device_caches.values():
        for compiled in caches[0].values():
            ptx, meta = compiled.asm.get("ptx", ""), compiled.metadata
            print(
                f"compiled: wgmma {ptx.count('wgmma.mma_async')} mma.sync {ptx.count('mma.sync')}"
                f" warps {meta.num_warps} stages {meta.num_stages} shared {meta.shared}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
