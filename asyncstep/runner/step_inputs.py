"""A step's inputs: from the persistent batch and the scheduler output to
device tensors (input ids, positions, slot mapping, attention metadata),
through the staging buffers, with the CUDA-graph mode and padded shape the
dispatcher picks and, when enabled, the step's two micro-batches.

A decode step (every request one token: ``total_num_scheduled_tokens ==
num_reqs``, the common case) takes a shorter path: no per-request Python,
the step's constant arrays (``query_start_loc``, the token counts) are
cached views, positions, seq lens and slots come from the batch's computed
counts in a few array operations, and the dispatcher's answer for a decode
shape is remembered. On any step the CUDA-graph runner restages only the
block table rows that changed, when the table is large (long contexts).
``fast_paths`` off: every step the general path (tests compare the two)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.config import CompilationConfig
from asyncstep.datatypes import IntermediateTensors, SchedulerOutput
from asyncstep.ops.attention import AttentionMetadata, plan_decode_buckets
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.cudagraph_dispatcher import (
    BatchDescriptor,
    CudagraphDispatcher,
    CUDAGraphMode,
)
from asyncstep.runner.cudagraph_runner import CudaGraphRunner, HostInputs
from asyncstep.runner.input_batch import InputBatch
from asyncstep.runner.spec_decode_metadata import SpecDecodeMetadata, build_spec_decode_metadata
from asyncstep.runner.staging import StagingBuffers
from asyncstep.runner.ubatch_forward import UBatchInputs
from asyncstep.runner.ubatching import (
    UBatchSlice,
    maybe_create_ubatch_slices,
    num_leading_decodes,
    split_host_metadata,
)

__all__ = ["StepInputBuilder", "StepInputs", "is_arange"]

#: (input_ids, seq_lens, cu_num_tokens) -> input_ids with device-only ids filled in.
ScatterFn = Callable[[torch.Tensor, np.ndarray, np.ndarray], torch.Tensor]


@dataclass
class StepInputs:
    """The device inputs of one step, and where to read logits from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    #: None for a FULL graph (its metadata is static, inside the graph runner).
    attn_metadata: AttentionMetadata | None
    #: Token index of each sampling request's last token (a slice when
    #: these are the first tokens in order: every request decoding).
    logits_indices: torch.Tensor | slice
    #: Batch rows that sample this step (their whole known sequence is computed).
    sample_rows: list[int]
    cudagraph_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor
    #: Two micro-batches (``enable_ubatching``), or None: the step runs whole.
    ubatches: list[UBatchInputs] | None = None
    #: A step with draft tokens: where they are; ``logits_indices`` then
    #: holds every draft position and each sampling row's bonus position.
    spec_decode_metadata: SpecDecodeMetadata | None = None


class StepInputBuilder:
    """Builds :class:`StepInputs` for a runner (whose persistent batch,
    staging buffers and dispatcher it shares)."""

    def __init__(
        self,
        input_batch: InputBatch,
        staging: StagingBuffers,
        dispatcher: CudagraphDispatcher,
        compilation: CompilationConfig,
        *,
        block_size: int,
        attention_backend: str,
        num_tokens_multiple: int,
        sequence_parallel: bool,
    ) -> None:
        self.input_batch = input_batch
        self.staging = staging
        self.dispatcher = dispatcher
        self.compilation = compilation
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.num_tokens_multiple = num_tokens_multiple
        self.sequence_parallel = sequence_parallel
        #: Set once the graphs are captured.
        self.graph_runner: CudaGraphRunner | None = None
        #: Steps run per runtime mode (NONE / PIECEWISE / FULL).
        self.cudagraph_steps: Counter[str] = Counter()
        self.num_ubatched_steps = 0
        n = input_batch.max_num_reqs
        #: Constant arrays of decode steps (views of their first ``num_reqs``).
        self._ones = _readonly(np.ones(n, dtype=np.int64))  # tokens per request
        self._cu_ones = _readonly(np.arange(1, n + 1, dtype=np.int64))  # their cumsum
        self._query_start_loc = np.arange(n + 1, dtype=np.int32)  # (never written)
        #: Token ``(row, position)`` of a decode step at ``_row_starts[row] + position``.
        self._row_starts = np.arange(n, dtype=np.int64) * input_batch.max_model_len
        #: The dispatcher's answer per uniform decode size (it never changes).
        self._decode_dispatch: dict[int, tuple[CUDAGraphMode, BatchDescriptor]] = {}
        #: False: every step takes the general path (tests compare the two).
        self.fast_paths = True

    def prepare(
        self,
        so: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None,
        scatter_sampled: ScatterFn,
    ) -> StepInputs:
        """The step's device inputs; ``scatter_sampled`` fills in the ids
        that only the device knows (async scheduling)."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        # Every request one token (each has at least one, and the batch holds the step's).
        decode = self.fast_paths and so.total_num_scheduled_tokens == num_reqs
        if decode:
            num_sched = self._ones[:num_reqs]
            cu_num_tokens = self._cu_ones[:num_reqs]
            host = self._decode_host_inputs()
            num_decodes = num_reqs
        else:
            scheduled = so.num_scheduled_tokens
            num_sched = np.fromiter(map(scheduled.__getitem__, batch.req_ids), np.int64, num_reqs)
            cu_num_tokens = np.cumsum(num_sched)
            host = self._host_inputs(num_sched, cu_num_tokens)
            num_decodes = int((num_sched == 1).sum())
        seq_lens = host.seq_lens
        num_input_tokens = -(-host.num_tokens // self.num_tokens_multiple) * (
            self.num_tokens_multiple
        )
        # A request samples once every token it has is in the cache.
        samples = seq_lens >= batch.num_tokens[:num_reqs]
        logits_indices: torch.Tensor | slice | None = None
        if samples.all():
            sample_rows = list(range(num_reqs))
            if decode:
                logits_indices = slice(0, num_reqs)  # token i is row i's last
        else:
            sample_rows = np.flatnonzero(samples).tolist()
        mode, desc, ubatch_slices = self._choose_mode(num_sched, num_input_tokens, num_decodes)
        self.cudagraph_steps[mode.name] += 1
        self.staging.begin_step()  # the last step's copies have read the buffers
        meta: AttentionMetadata | None = None
        if mode is CUDAGraphMode.NONE:
            input_ids, positions_t, meta = self._eager_inputs(host, num_input_tokens, num_decodes)
        else:
            assert self.graph_runner is not None
            self.graph_runner.load_inputs(desc, host, intermediate_tensors)
            input_ids, positions_t = self.graph_runner.input_views(desc.num_tokens)
            if mode is CUDAGraphMode.PIECEWISE:  # attention runs eagerly, on the exact batch
                meta = self.graph_runner.eager_meta(
                    host, desc.num_tokens, self._host_meta(host, num_decodes)
                )
                for g, group_meta in enumerate((meta, *meta.kv_groups)):
                    self._plan_buckets(group_meta, host.seq_lens, _group_prefix(g))
        spec_metadata = None
        if so.scheduled_spec_decode_tokens and sample_rows:
            logits_indices, spec_metadata = self._spec_logits_indices(
                so.scheduled_spec_decode_tokens, sample_rows, cu_num_tokens
            )
        elif logits_indices is None:
            logits_indices = self._logits_indices(cu_num_tokens[sample_rows] - 1)
        if not so.scheduled_spec_decode_tokens:
            input_ids = scatter_sampled(input_ids, seq_lens, cu_num_tokens)
        # (else nothing to scatter: the runner resolved every sampled output
        # before a step with drafts, whose drafts are in the rows past num_tokens)
        inputs = StepInputs(
            input_ids=input_ids,
            positions=positions_t,
            attn_metadata=meta,
            logits_indices=logits_indices,
            sample_rows=sample_rows,
            cudagraph_mode=mode,
            batch_descriptor=desc,
            spec_decode_metadata=spec_metadata,
        )
        if ubatch_slices is not None:
            assert meta is not None
            inputs.ubatches = [
                self._ubatch_inputs(inputs, host, meta, sl, i, intermediate_tensors)
                for i, sl in enumerate(ubatch_slices)
            ]
        self.staging.end_step()
        return inputs

    def _spec_logits_indices(
        self, spec_tokens: dict[str, list[int]], sample_rows: list[int], cu_num_tokens: np.ndarray
    ) -> tuple[torch.Tensor | slice, SpecDecodeMetadata]:
        """A speculative step's logits indices (every draft position and each
        sampling row's bonus position) and its :class:`SpecDecodeMetadata`."""
        req_ids = self.input_batch.req_ids
        drafts = [spec_tokens.get(req_ids[row], []) for row in sample_rows]
        indices, metadata = build_spec_decode_metadata(
            drafts, cu_num_tokens[sample_rows], self.input_batch.device
        )
        return self._logits_indices(indices), metadata

    def _logits_indices(self, indices: np.ndarray) -> torch.Tensor | slice:
        if is_arange(indices):
            return slice(0, len(indices))  # no copy, no gather
        return self.staging.to_device("logits_indices", indices)

    def _host_inputs(self, num_sched: np.ndarray, cu_num_tokens: np.ndarray) -> HostInputs:
        """Token ids, positions, slots and request metadata, on the host."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        total = int(cu_num_tokens[-1])
        req_indices = np.repeat(np.arange(num_reqs), num_sched)
        offsets = np.arange(total) - np.repeat(cu_num_tokens - num_sched, num_sched)
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = computed[req_indices] + offsets
        token_index = req_indices * batch.max_model_len + positions
        table = batch.block_table
        return HostInputs(
            input_ids=batch.token_ids_flat[token_index].astype(np.int64),
            positions=positions,
            slot_mapping=table.compute_slot_mapping(req_indices, positions),
            query_start_loc=np.concatenate([[0], cu_num_tokens]).astype(np.int32),
            seq_lens=(computed + num_sched).astype(np.int32),
            block_table=table.group_table(0, num_reqs),
            block_table_source=table if self.fast_paths else None,
            group_slot_mappings=[
                table.compute_slot_mapping(req_indices, positions, g)
                for g in range(1, table.num_groups)
            ],
            group_block_tables=_group_tables(table, num_reqs),
        )

    def _decode_host_inputs(self) -> HostInputs:
        """:meth:`_host_inputs` of a decode step (token ``i`` is row ``i``'s
        next one, at its computed count), in a few array operations."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        positions = computed.astype(np.int64)
        table = batch.block_table
        return HostInputs(
            input_ids=batch.token_ids_flat.take(self._row_starts[:num_reqs] + positions).astype(
                np.int64
            ),
            positions=positions,
            slot_mapping=table.decode_slot_mapping(positions),
            query_start_loc=self._query_start_loc[: num_reqs + 1],
            seq_lens=computed + 1,
            block_table=table.group_table(0, num_reqs),
            block_table_source=table,  # (the fast path only)
            group_slot_mappings=list(table.decode_group_slot_mappings(positions)),
            group_block_tables=_group_tables(table, num_reqs),
        )

    def _choose_mode(
        self, num_sched: np.ndarray, num_input_tokens: int, num_decodes: int
    ) -> tuple[CUDAGraphMode, BatchDescriptor, list[UBatchSlice] | None]:
        """The dispatcher's graph and padded shape; eager without captured
        graphs, or when the step runs as two micro-batches."""
        num_reqs = len(num_sched)
        uniform = num_decodes == num_reqs
        q = self.dispatcher.uniform_decode_query_len
        if not uniform and q > 1 and num_input_tokens == q * num_reqs:
            # A verify step where every request has all its k drafts (or any
            # batch of exactly q tokens a request: its graph runs any such).
            uniform = bool((num_sched == q).all())
        if uniform and num_input_tokens == num_reqs and self.fast_paths:
            cached = self._decode_dispatch.get(num_reqs)
            if cached is None:
                cached = self.dispatcher.dispatch(num_input_tokens, num_reqs, True)
                self._decode_dispatch[num_reqs] = cached
            mode, desc = cached
        else:
            mode, desc = self.dispatcher.dispatch(num_input_tokens, num_reqs, uniform)
        ubatch_slices = self._ubatch_slices(num_sched, num_input_tokens, num_decodes == num_reqs)
        if ubatch_slices is not None:
            self.num_ubatched_steps += 1
        if self.graph_runner is None or ubatch_slices is not None:
            mode, desc = CUDAGraphMode.NONE, BatchDescriptor(num_input_tokens, num_reqs)
        return mode, desc, ubatch_slices

    def _ubatch_slices(
        self, num_sched: np.ndarray, num_input_tokens: int, uniform_decode: bool
    ) -> list[UBatchSlice] | None:
        config = self.compilation
        if not config.enable_ubatching or self.sequence_parallel:
            return None
        if self.input_batch.block_table.num_groups > 1:
            return None  # a micro-batch's metadata would need every group's

        return maybe_create_ubatch_slices(
            num_sched,
            num_input_tokens,
            uniform_decode=uniform_decode,
            decode_threshold=config.ubatch_decode_threshold,
            prefill_threshold=config.ubatch_prefill_threshold,
        )

    def _ubatch_inputs(
        self,
        inputs: StepInputs,
        host: HostInputs,
        meta: AttentionMetadata,
        ubatch: UBatchSlice,
        index: int,
        intermediate_tensors: IntermediateTensors | None,
    ) -> UBatchInputs:
        """One micro-batch's slice of the step's inputs, with its own metadata."""
        split = split_host_metadata(ubatch, host.query_start_loc, host.seq_lens)
        tokens, reqs = ubatch.token_slice, ubatch.request_slice
        to_device = self.staging.to_device
        ub_meta = AttentionMetadata(
            num_actual_tokens=ubatch.num_tokens,
            num_decodes=num_leading_decodes(split.query_start_loc),
            query_start_loc=to_device(f"ub{index}_query_start_loc", split.query_start_loc),
            seq_lens=to_device(f"ub{index}_seq_lens", split.seq_lens),
            block_table=meta.block_table[reqs],
            slot_mapping=meta.slot_mapping[tokens],
            positions=inputs.positions[tokens],
            max_query_len=int(np.diff(split.query_start_loc).max()),
            max_seq_len=int(split.seq_lens.max()),
            query_start_loc_cpu=split.query_start_loc,
            seq_lens_cpu=split.seq_lens,
        )
        self._plan_buckets(ub_meta, split.seq_lens, f"ub{index}_")
        received = None
        if intermediate_tensors is not None:
            received = IntermediateTensors(
                {k: v[tokens] for k, v in intermediate_tensors.tensors.items()}
            )
        return UBatchInputs(inputs.input_ids[tokens], inputs.positions[tokens], ub_meta, received)

    def _host_meta(self, host: HostInputs, num_decodes: int) -> AttentionMetadata:
        """The step's metadata; device tensors are filled in by the caller."""
        empty = torch.empty(0)
        return AttentionMetadata(
            num_actual_tokens=host.num_tokens,
            num_decodes=num_decodes,
            query_start_loc=empty,
            seq_lens=empty,
            block_table=empty,
            slot_mapping=empty,
            max_query_len=(
                1 if num_decodes == host.num_reqs else int(np.diff(host.query_start_loc).max())
            ),
            max_seq_len=int(host.seq_lens.max()),
            query_start_loc_cpu=host.query_start_loc,
            seq_lens_cpu=host.seq_lens,
        )

    def _plan_buckets(self, meta: AttentionMetadata, seq_lens: np.ndarray, name: str = "") -> None:
        """The reference backend's decode plan (the Triton kernels need none).
        ``name`` prefixes its staging buffers' names: each plan of a step
        (a KV cache group's, a micro-batch's) needs buffers of its own (a
        non-blocking copy may still read one when the next plan writes)."""
        if self.attention_backend != "torch":
            return
        n = meta.num_decodes
        meta.decode_buckets = plan_decode_buckets(
            seq_lens[:n],
            meta.block_table[:n],
            self.block_size,
            to_device=lambda key, array: self.staging.to_device(name + key, array),
        )

    def _eager_inputs(
        self, host: HostInputs, num_input_tokens: int, num_decodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device inputs of an eager step; padding tokens (SP: id 0, position
        0, slot -1) after the real ones."""
        to_device = self.staging.to_device
        meta = self._host_meta(host, num_decodes)
        num_blocks = -(-meta.max_seq_len // self.block_size)
        meta.block_table = to_device("block_table", host.block_table[:, :num_blocks])
        meta.query_start_loc = to_device("query_start_loc", host.query_start_loc)
        meta.seq_lens = to_device("seq_lens", host.seq_lens)
        meta.slot_mapping = to_device("slot_mapping", _pad(host.slot_mapping, num_input_tokens, -1))
        self._plan_buckets(meta, host.seq_lens)
        input_ids = to_device("input_ids", _pad(host.input_ids, num_input_tokens, 0))
        positions = to_device("positions", _pad(host.positions, num_input_tokens, 0))
        meta.positions = positions
        if host.group_slot_mappings:
            meta.kv_groups = [
                self._group_meta(meta, host, g, num_input_tokens, num_blocks)
                for g in range(1, len(host.group_slot_mappings) + 1)
            ]
        return input_ids, positions, meta

    def _group_meta(
        self,
        meta: AttentionMetadata,
        host: HostInputs,
        group: int,
        num_input_tokens: int,
        num_blocks: int,
    ) -> AttentionMetadata:
        """KV cache group ``group``'s metadata: ``meta`` with the group's
        block table, slots and decode plan."""
        to_device = self.staging.to_device
        table = host.group_block_tables[group - 1]
        slots = _pad(host.group_slot_mappings[group - 1], num_input_tokens, -1)
        group_meta = dataclasses.replace(
            meta,
            block_table=to_device(f"block_table_g{group}", table[:, :num_blocks]),
            slot_mapping=to_device(f"slot_mapping_g{group}", slots),
            decode_buckets=[],
            kernel_args=None,
            kv_groups=[],
        )
        self._plan_buckets(group_meta, host.seq_lens, _group_prefix(group))
        return group_meta


def is_arange(indices: np.ndarray) -> bool:
    """Whether ``indices`` is ``0, 1, ..., len - 1``."""
    n = len(indices)
    return n == 0 or (
        int(indices[0]) == 0 and int(indices[-1]) == n - 1 and bool((np.diff(indices) == 1).all())
    )


def _group_prefix(group: int) -> str:
    """Staging buffer names of KV cache group ``group``'s plan (group 0: the step's)."""
    return f"g{group}_" if group else ""


def _group_tables(table: BlockTable, num_reqs: int) -> list[np.ndarray]:
    """KV cache groups 1.. block tables of rows ``[0, num_reqs)`` (views)."""
    return [table.group_table(g, num_reqs) for g in range(1, table.num_groups)]


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _pad(array: np.ndarray, length: int, value: int) -> np.ndarray:
    """``array`` followed by ``value`` up to ``length`` entries."""
    if len(array) == length:
        return array
    return np.pad(array, (0, length - len(array)), constant_values=value)
