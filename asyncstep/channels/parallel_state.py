"""Process groups of this rank: the tensor-parallel (TP) and pipeline-parallel
(PP) groups, vLLM's ``GroupCoordinator`` shape.

A group of one rank needs no ``torch.distributed`` at all: its collectives are
the identity, so a single-rank run never initialises a process group. The
model's layers ask ``get_tp_group()`` / ``get_pp_group()``; the rank's launcher
sets them once with :func:`set_parallel_groups` before the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupCoordinator:
    """One process group seen from one of its ranks."""

    ranks: tuple[int, ...]
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls) -> GroupCoordinator:
        return cls(ranks=(0,), rank_in_group=0)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place where the backend allows; returns the sum."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)


_TP = GroupCoordinator.single()
_PP = GroupCoordinator.single()


def set_parallel_groups(tp: GroupCoordinator, pp: GroupCoordinator) -> None:
    """Set this process's TP and PP groups (once, before building the model)."""
    global _TP, _PP
    _TP, _PP = tp, pp


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP
