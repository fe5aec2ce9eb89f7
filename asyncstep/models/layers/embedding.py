"""Vocab-parallel embedding and LM head: the vocabulary is split in
contiguous ranges over the TP group (padded to a multiple of tp_size)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncstep.channels import get_tp_group
from asyncstep.errors import ModelLoadError
from asyncstep.models.layers.linear import packed_linear, reduce_partial_sums
from asyncstep.ops.cpu.dense import CpuDenseMatmul, dense_matmul
from asyncstep.ops.cpu.quant import CpuQuantWeight
from asyncstep.ops.packed import PackedWeight


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

    #: The weight packed for the CPU (set after loading).
    packed: PackedWeight | None = None
    #: One-row steps of a 16-bit model on CUDA through the Triton GEMV.
    dense_gemv: bool = False

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits of ``hidden_states``' rows: on the CPU float32 from the
        library's packed head or its dense bfloat16 matmul (float32 sums, not
        rounded to the model's dtype: a bfloat16 logit of ~20 moves in steps
        of 0.125, which ties tokens that float32 separates), else in the
        model's dtype."""
        packed = self.packed
        if isinstance(packed, CpuQuantWeight) and packed.applies(hidden_states):
            logits = packed.mm(hidden_states, torch.float32)
        elif (matmul := _cpu_bfloat16_matmul(self.weight)) is not None:
            logits = matmul(hidden_states, self.weight)
        else:
            logits = packed_linear(hidden_states, self.weight, packed, dense_gemv=self.dense_gemv)
        if self.tp_size > 1:
            logits = get_tp_group().all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]


def _cpu_bfloat16_matmul(weight: torch.Tensor) -> CpuDenseMatmul | None:
    """The CPU library's dense matmul for a bfloat16 weight on the CPU (None
    elsewhere, or where the library is off)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    return dense_matmul()
