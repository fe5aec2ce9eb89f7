"""The op set a model's layers share: one :class:`OpSetSlot` per model,
holding the op set they call, chosen once per model
(:func:`~asyncstep.ops.select.select_ops`) and set in one assignment.

May import :mod:`asyncstep.ops`' base and reference.
"""

from __future__ import annotations

from asyncstep.ops.base import OpSet
from asyncstep.ops.torch_ref import TORCH_OPS

__all__ = ["OpSetSlot"]


class OpSetSlot:
    """The op set a model's layers share: ``ops`` is read at every call and
    set once by whoever runs the model (the reference until then)."""

    __slots__ = ("ops",)

    def __init__(self, ops: OpSet | None = None) -> None:
        self.ops: OpSet = TORCH_OPS if ops is None else ops

    def __deepcopy__(self, memo: dict[int, object]) -> OpSetSlot:
        """A copied model gets a slot of its own holding the same op set (an
        op set holds kernels, not state: it is shared, never copied)."""
        return OpSetSlot(self.ops)
