""":class:`IntermediateTensors`: activations passed between pipeline
stages. Imports nothing at run time (torch for its types only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class IntermediateTensors:
    """Activations passed between pipeline stages (``hidden_states``, ``residual``)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)
