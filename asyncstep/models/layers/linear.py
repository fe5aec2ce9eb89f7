"""Tensor-parallel linear layers: column-parallel (QKV, merged gate/up),
row-parallel (o_proj, down_proj) with all-reduce, and replicated (a MoE
router: the whole weight on every rank, never packed).

With sequence parallelism (Megatron-SP) the activations between the layers
are split along tokens: each TP rank holds ``num_tokens / tp_size`` rows. A
column-parallel layer then all-gathers its input rows first, and a
row-parallel layer reduce-scatters its partial sums along tokens instead of
all-reducing them: the reduce-scatter and the next all-gather move what one
all-reduce does, and the norms and residual adds in between run on
``1 / tp_size`` of the rows.

The matmul is the model's op set's (:meth:`~asyncstep.ops.base.OpSet.linear`):
a layer holds its dense weight and, set after loading, a packed copy whose
format carries its own matmul; no flag chooses a kernel here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from asyncstep.channels import get_tp_group
from asyncstep.errors import ModelLoadError
from asyncstep.ops.packed import PackedWeight
from asyncstep.ops.slot import OpSetSlot

WeightLoader = Callable[..., None]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ModelLoadError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator


def gather_tokens(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Under sequence parallelism, every rank's token rows, concatenated in rank order."""
    return get_tp_group().all_gather(x, dim=0) if sequence_parallel else x


def reduce_partial_sums(x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Sum partial results over the TP group: all-reduce, or under sequence
    parallelism reduce-scatter along tokens (this rank keeps its rows)."""
    tp = get_tp_group()
    return tp.reduce_scatter(x, dim=0) if sequence_parallel else tp.all_reduce(x)


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(
            f"weight {name}: checkpoint shape {tuple(loaded.shape)} does not match "
            f"the model's {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


def _make_param(shape: Sequence[int], dtype: torch.dtype, loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


class ReplicatedLinear(nn.Module):
    """``y = x A^T (+ b)``, the whole of A on every rank (a MoE router's gate); its
    weight stays dense (the CPU packing takes the parallel layers only)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = _make_param((output_size, input_size), params_dtype, self.weight_loader)
        self.bias = _make_param((output_size,), params_dtype, self.weight_loader) if bias else None
        #: The model's op set.
        self.ops = ops or OpSetSlot()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_checked(param, loaded, "replicated")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.ops.linear(x, self.weight, None, self.bias)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its output rows over the TP group.

    Each rank computes its slice of the output features; with
    ``gather_output`` the slices are all-gathered (rarely wanted: the next
    layer is usually row-parallel and consumes the slice as is). With
    ``sequence_parallel`` the input is this rank's token rows, all-gathered
    before the matmul.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, self.tp_size, "output features")
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.weight = _make_param(
            (self.output_size_per_partition, input_size), params_dtype, self.weight_loader
        )
        self.bias = (
            _make_param((self.output_size_per_partition,), params_dtype, self.weight_loader)
            if bias
            else None
        )
        #: The weight packed (set after loading): its format carries its matmul.
        self.packed: PackedWeight | None = None
        #: The model's op set.
        self.ops = ops or OpSetSlot()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        _copy_checked(param, loaded.narrow(0, self.tp_rank * shard, shard), "column-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_tokens(x, self.sequence_parallel)
        y = self.ops.ops.linear(x, self.weight, self.packed, self.bias)
        if self.gather_output:
            y = get_tp_group().all_gather(y, dim=-1)
        return y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul
    (gate_proj and up_proj). Shard ``i`` of every rank is that rank's slice of
    projection ``i``."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias=bias,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            ops=ops,
        )

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int
    ) -> None:
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy_checked(
            param.data.narrow(0, offset, shard),
            loaded.narrow(0, self.tp_rank * shard, shard),
            f"merged shard {shard_id}",
        )


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection, split by attention heads: each rank holds
    ``num_heads / tp`` query heads and ``num_kv_heads / tp`` key/value heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ) -> None:
        tp_size = get_tp_group().world_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "attention heads")
        self.num_kv_heads = divide(num_kv_heads, tp_size, "key/value heads")
        output_size = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(
            hidden_size,
            output_size,
            bias=bias,
            sequence_parallel=sequence_parallel,
            params_dtype=params_dtype,
            ops=ops,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(  # type: ignore[override]
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str
    ) -> None:
        sizes = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        offsets = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        shard = sizes[shard_id]
        _copy_checked(
            param.data.narrow(0, offsets[shard_id], shard),
            loaded.narrow(0, self.tp_rank * shard, shard),
            f"qkv shard {shard_id}",
        )


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its input columns: each rank
    multiplies its slice of the input features, then the partial sums are
    all-reduced over the TP group (the bias is added once, after the sum;
    on one rank, by the op set's ``linear``).
    With ``sequence_parallel`` they are reduce-scattered along tokens instead:
    each rank gets the summed output of its ``1 / tp_size`` of the rows."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = False,
        reduce_results: bool = True,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        ops: OpSetSlot | None = None,
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size_per_partition = divide(input_size, self.tp_size, "input features")
        self.output_size = output_size
        self.reduce_results = reduce_results
        self.sequence_parallel = sequence_parallel
        self.weight = _make_param(
            (output_size, self.input_size_per_partition), params_dtype, self.weight_loader
        )
        self.bias = _make_param((output_size,), params_dtype, self.weight_loader) if bias else None
        #: The weight packed (set after loading): its format carries its matmul.
        self.packed: PackedWeight | None = None
        #: The model's op set.
        self.ops = ops or OpSetSlot()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is whole on every rank
            _copy_checked(param, loaded, "row-parallel bias")
            return
        shard = param.shape[1]
        _copy_checked(param, loaded.narrow(1, self.tp_rank * shard, shard), "row-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # nothing to reduce: the bias in the op set's linear
            return self.ops.ops.linear(x, self.weight, self.packed, self.bias)
        y = self.ops.ops.linear(x, self.weight, self.packed)
        if self.reduce_results:
            y = reduce_partial_sums(y, self.sequence_parallel)
        if self.bias is not None:
            y = y + self.bias
        return y
