"""Vocab-parallel embedding and LM head: the vocabulary is split in
contiguous ranges over the TP group (padded to a multiple of tp_size)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncstep.channels import get_tp_group
from asyncstep.errors import ModelLoadError
from asyncstep.models.layers.linear import reduce_partial_sums
from asyncstep.ops.packed import PackedWeight
from asyncstep.ops.slot import OpSetSlot


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows ``[vocab_start, vocab_end)``; tokens outside the
    range look up zeros, and the all-reduce sums the one non-zero row. With
    ``sequence_parallel`` a reduce-scatter along tokens sums them instead:
    each rank gets its ``1 / tp_size`` of the token rows."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype,
        *,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.sequence_parallel = sequence_parallel
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.num_embeddings, param.shape[1]):
            raise ModelLoadError(
                f"embedding: checkpoint shape {tuple(loaded.shape)}, expected "
                f"{(self.num_embeddings, param.shape[1])}"
            )
        rows = loaded[self.vocab_start : self.vocab_end]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return reduce_partial_sums(out, self.sequence_parallel)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split like the embedding; logits are gathered."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype,
        *,
        ops: OpSetSlot | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, dtype)
        #: The weight packed (set after loading): its format carries its matmul.
        self.packed: PackedWeight | None = None
        #: The model's op set (:meth:`~asyncstep.ops.base.OpSet.logits`).
        self.ops = ops or OpSetSlot()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden_states``' rows, from the op set: float32 on
        the CPU where the library sums so (see
        :meth:`~asyncstep.ops.base.OpSet.logits`), else the model's dtype."""
        logits = self.ops.ops.logits(hidden_states, self.weight, self.packed)
        if self.tp_size > 1:
            logits = get_tp_group().all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]
