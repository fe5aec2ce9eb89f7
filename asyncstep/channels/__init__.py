"""Communication between ranks: process groups and the collectives the model's
tensor-parallel layers use, and (with pipeline parallelism) the tensor-dict
channel between stages; the typed control-plane messages, and the one
framing (with its authenticating handshake) of every asyncstep connection.

May import torch, msgspec, ``asyncstep.device`` and the shared
``asyncstep.datatypes`` / ``config`` / ``errors``. Never pickle: metadata travels as msgspec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncstep.channels.parallel_state import (
        GroupCoordinator,
        get_ep_group,
        get_pp_group,
        get_tp_group,
        set_parallel_groups,
    )

__all__ = [
    "GroupCoordinator",
    "get_ep_group",
    "get_pp_group",
    "get_tp_group",
    "set_parallel_groups",
]


def __getattr__(name: str) -> Any:
    """The process-group names, imported on first use: the framing of every
    connection lives in this package too, and a caller's process that only
    talks to an engine core must not pay for importing torch."""
    if name in __all__:
        from asyncstep.channels import parallel_state

        return getattr(parallel_state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
