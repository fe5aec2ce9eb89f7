"""Host time of applying a grammar bitmask to a step's logits on the GPU
(``GrammarBitmask.apply``: staging the rows, unpacking the bits, masking),
at batch 1 and 32 with llama-1b's vocabulary, and its cProfile.

    python benchmarks/studies/structured/grammar_apply.py
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

from asyncstep.datatypes import GrammarOutput
from asyncstep.runner.grammar_bitmask import GrammarBitmask

VOCAB = 128256


def main() -> int:
    device = torch.device("cuda")
    for batch in (1, 32):
        words = (VOCAB + 31) // 32
        applier = GrammarBitmask(device)
        bitmask = np.random.randint(-(2**31), 2**31 - 1, size=(batch, words), dtype=np.int32)
        req_ids = [f"r{i}" for i in range(batch)]
        grammar_output = GrammarOutput(1, req_ids, bitmask.tobytes())
        rows = {r: i for i, r in enumerate(req_ids)}
        logits = torch.randn(batch, VOCAB, dtype=torch.bfloat16, device=device)
        for _ in range(5):
            applier.apply(logits, grammar_output, rows)
        torch.cuda.synchronize()
        times = []
        for _ in range(50):
            start = time.perf_counter()
            applier.apply(logits, grammar_output, rows)
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        print(f"batch {batch}: apply host median {statistics.median(times) * 1e6:.0f} us")
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(50):
            applier.apply(logits, grammar_output, rows)
        profile.disable()
        torch.cuda.synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
