"""Communication between ranks: process groups and the collectives the model's
tensor-parallel layers use, and (with pipeline parallelism) the tensor-dict
channel between stages; the typed control-plane messages, and the one
framing (with its authenticating handshake) of every asyncstep connection.

May import torch, msgspec, ``asyncstep.gpu`` and the shared
``asyncstep.datatypes`` / ``config`` / ``errors``. Never pickle: metadata travels as msgspec.
"""

from asyncstep.channels.parallel_state import (
    GroupCoordinator,
    get_pp_group,
    get_tp_group,
    set_parallel_groups,
)

__all__ = ["GroupCoordinator", "get_pp_group", "get_tp_group", "set_parallel_groups"]
