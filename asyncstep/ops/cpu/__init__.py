"""The CPU library (C sources compiled on first use, :mod:`.library`; its
bindings: paged attention, the layer ops, the quantized and dense bfloat16
matmuls) and the CPU op set (:mod:`.ops`).

May import torch, numpy, :mod:`asyncstep.cpu_features`,
:mod:`asyncstep.logging`, :mod:`asyncstep.errors` and :mod:`asyncstep.ops`'
base, reference and packed formats.
"""
