"""Kernels, chosen once per model: the op-set protocol (:mod:`.base`), the
reference (:mod:`.torch_ref`), the CPU library and its op set (:mod:`.cpu`),
the Triton op set (:mod:`.triton`), the packed weight formats
(:mod:`.packed`), the choice (:mod:`.select`) and the slot a model's layers
share (:mod:`.slot`). Models hold weights and call their op set; whoever
runs a model selects it.

May import torch, numpy, triton (lazily), :mod:`asyncstep.device`,
:mod:`asyncstep.cpu_features`, :mod:`asyncstep.logging` and
:mod:`asyncstep.errors`: nothing of the models, the runner or above.
"""

from asyncstep.ops.base import OpSet, RotaryCosSin
from asyncstep.ops.select import resolve_attention_backend, select_ops
from asyncstep.ops.slot import OpSetSlot
from asyncstep.ops.torch_ref import TORCH_OPS, TorchOps

__all__ = [
    "TORCH_OPS",
    "OpSet",
    "OpSetSlot",
    "RotaryCosSin",
    "TorchOps",
    "resolve_attention_backend",
    "select_ops",
]
