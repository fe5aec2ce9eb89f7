"""Runs a step's forward through CUDA graphs chosen by batch shape.

The runner keeps static device buffers for the step inputs (input ids,
positions, slot mapping, ``query_start_loc``, seq lens, block table and, on
later pipeline stages, the received hidden states and residual). Each step
the host arrays are copied into them, padded to the dispatched
:class:`BatchDescriptor` (padding: id 0, position 0, slot -1; padding
requests seq_len 0 with an empty query range), and the graph replays.

With several KV cache groups (a model mixing sliding-window and full
attention layers) every group has its own static block table and slot
mapping, staged the same way (padding slots -1 in each): the block table
buffer holds a row's groups side by side (``[rows, groups * blocks]``,
group ``g``'s columns ``g * blocks ..``), the groups' slots are a buffer
of their own; the static metadata's ``kv_groups`` view them, so each
layer's attention reads its group's, in FULL graphs and PIECEWISE alike.

* FULL: the whole stage forward is one graph; attention reads only device
  metadata (the Triton backend), so one graph serves every batch of its shape.
  A uniform decode graph of the last stage also computes the logits of
  every row (a one-token decode: row i is request i's; a speculative
  verify of ``1 + k`` tokens a request: every row is a draft's or a bonus
  position's; padding rows' logits are garbage): the LM head is then no
  eager launch of its own. Its attention runs on the step's device
  metadata: any batch of at most its tokens and requests runs right in it.
  With ``greedy_in_graph``, a one-token decode graph also ends with the
  argmax of its logits (:mod:`asyncstep.runner.greedy_graph`).
* PIECEWISE: the forward is cut at each attention: graph 0 runs up to the
  first layer's q/k/v, graph i from layer i-1's attention output to layer i's
  q/k/v, the last graph to the stage's output. Attention runs eagerly in
  between, with the step's exact metadata (any backend). The q/k/v,
  attention output and residual crossing a cut live in static buffers shared
  by every size (one size runs at a time).

Capture happens once at start-up, largest shape first, into one shared pool.
Without CUDA an :class:`~asyncstep.device.cuda_graph.EagerGraph` stands in, so
the wiring (padding, buffers, cuts) is tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncstep.datatypes import IntermediateTensors
from asyncstep.device.cuda_graph import Graph, GraphPool, capture_graph
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.ops.attention import AttentionMetadata
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.cudagraph_dispatcher import (
    BatchDescriptor,
    CudagraphDispatcher,
    CUDAGraphMode,
)
from asyncstep.runner.greedy_graph import GreedyGraphIds
from asyncstep.runner.staging import StagedArena

__all__ = ["CudaGraphRunner", "HostInputs"]

StageOutput = torch.Tensor | IntermediateTensors


@dataclass
class HostInputs:
    """One step's inputs on the host, unpadded."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, blocks] int32
    #: The table ``block_table`` views (its rows ``[0, num_reqs)``): the graph
    #: runner then restages only the rows it marks as changed. None: restage all.
    block_table_source: BlockTable | None = None
    #: With several KV cache groups: groups 1.. slot mappings (``slot_mapping``
    #: and ``block_table`` are group 0's); empty with one group.
    group_slot_mappings: list[np.ndarray] = field(default_factory=list)
    #: Groups 1.. block tables (rows ``[0, num_reqs)``), beside ``group_slot_mappings``.
    group_block_tables: list[np.ndarray] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


@dataclass
class _Cut:
    """The tensors crossing a piecewise cut (views of the static buffers)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_out: torch.Tensor
    residual: torch.Tensor


class CudaGraphRunner:
    """Static buffers, captured graphs, and the replay of one step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        dispatcher: CudagraphDispatcher,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_num_reqs: int,
        max_blocks_per_req: int,
        num_kv_groups: int = 1,
        stand_in: bool = False,
        greedy_in_graph: bool = False,
    ) -> None:
        """``max_blocks_per_req``: of one KV cache group; ``num_kv_groups``:
        the model's KV cache groups (each gets its block table and slots);
        ``greedy_in_graph``: one-token decode graphs end with the argmax of
        their logits (:attr:`greedy`)."""
        self.model = model
        self.dispatcher = dispatcher
        self.device, self.dtype = device, dtype
        self.pool = GraphPool(device, stand_in)
        n = max(dispatcher.max_graph_tokens, dispatcher.max_capture_size, 1)
        r = max(max_num_reqs, 1)
        self.max_num_tokens, self.max_num_reqs = n, r

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.num_kv_groups, self.max_blocks_per_req = num_kv_groups, max_blocks_per_req
        # The step's inputs, uploaded with one copy (the block table last:
        # only its rows in use are copied).
        self.inputs = StagedArena(
            device,
            {
                "input_ids": ((n,), torch.int64),
                "positions": ((n,), torch.int64),
                "slot_mapping": ((n,), torch.int64),
                "group_slot_mappings": ((num_kv_groups - 1, n), torch.int64),
                "query_start_loc": ((r + 1,), torch.int32),
                "seq_lens": ((r,), torch.int32),
                "block_table": ((r, num_kv_groups * max_blocks_per_req), torch.int32),
            },
        )
        static = self.inputs.tensors
        self.input_ids, self.positions = static["input_ids"], static["positions"]
        self.slot_mapping = static["slot_mapping"]
        self.query_start_loc, self.seq_lens = static["query_start_loc"], static["seq_lens"]
        #: Group 0's block table (with one group, the whole buffer).
        self.block_table = self._group_block_table(0)
        #: The staged block table's host view by group: ``[rows, groups, blocks]``.
        staged_table = self.inputs.host["block_table"]
        self._staged_groups = staged_table.reshape(r, num_kv_groups, max_blocks_per_req)
        assert np.shares_memory(self._staged_groups, staged_table)
        config = model.config
        self.layers = model.model.stage_layers()
        attn = self.layers[0].self_attn
        hidden = config.hidden_size
        self._cut_buffers = _Cut(
            q=zeros(n, attn.q_size, dtype=dtype),
            k=zeros(n, attn.kv_size, dtype=dtype),
            v=zeros(n, attn.kv_size, dtype=dtype),
            attn_out=zeros(n, attn.q_size, dtype=dtype),
            residual=zeros(n, hidden, dtype=dtype),
        )
        self._received = {
            key: zeros(n, hidden, dtype=dtype) for key in ("hidden_states", "residual")
        }
        self.full_graphs: dict[BatchDescriptor, Graph[StageOutput]] = {}
        #: The FULL graphs that end with the logits (uniform decode, last stage).
        self.logits_graphs: set[BatchDescriptor] = set()
        self.piecewise_graphs: dict[BatchDescriptor, list[Graph[StageOutput | None]]] = {}
        #: The ids the greedy graphs write (None: ``greedy_in_graph`` off),
        #: and those graphs.
        self.greedy = GreedyGraphIds(n, device) if greedy_in_graph else None
        self.greedy_graphs: set[BatchDescriptor] = set()
        #: The block table whose rows the staged block table holds (up to
        #: the rows it has marked as changed since), if any.
        self._staged_block_table: BlockTable | None = None

    # -- inputs -------------------------------------------------------------

    def _rows(self, num_tokens: int) -> int:
        """Rows of the residual stream for ``num_tokens`` (token shards under SP)."""
        return num_tokens // self.model.num_tokens_multiple

    def _static_meta(
        self, desc: BatchDescriptor, num_reqs: int, num_actual: int
    ) -> AttentionMetadata:
        n = desc.num_tokens
        meta = AttentionMetadata(
            num_actual_tokens=num_actual,
            num_decodes=0,
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:n],
            # A uniform graph's query length (1: the fused decode attention).
            max_query_len=n // max(num_reqs, 1) if desc.uniform_decode else n,
            max_seq_len=0,
            query_start_loc_cpu=np.zeros(num_reqs + 1, dtype=np.int32),
            seq_lens_cpu=np.zeros(num_reqs, dtype=np.int32),
            positions=self.positions[:n],
        )
        meta.kv_groups = self._group_metas(meta, num_reqs, n)
        return meta

    # -- KV cache groups ------------------------------------------------------

    def _group_block_table(self, group: int) -> torch.Tensor:
        """KV cache group ``group``'s static block table ``[rows, blocks]``
        (a view of its columns of the shared buffer)."""
        b = self.max_blocks_per_req
        return self.inputs.tensors["block_table"][:, group * b : (group + 1) * b]

    def _group_metas(
        self, meta: AttentionMetadata, num_reqs: int, num_tokens: int
    ) -> list[AttentionMetadata]:
        """Groups 1.. metadata: ``meta`` (group 0's) with the group's static
        block table and slots (empty with one group)."""
        slots = self.inputs.tensors["group_slot_mappings"]
        return [
            dataclasses.replace(
                meta,
                block_table=self._group_block_table(g)[:num_reqs],
                slot_mapping=slots[g - 1, :num_tokens],
                decode_buckets=[],
                kernel_args=None,
                kv_groups=[],
            )
            for g in range(1, self.num_kv_groups)
        ]

    def _stage_group_slots(self, host: HostInputs, num_tokens: int) -> None:
        """Groups 1.. slot mappings into their staged rows, padded with -1
        (a padding token stores nothing in any group)."""
        if not host.group_slot_mappings:
            return
        staged, t = self.inputs.host["group_slot_mappings"], host.num_tokens
        staged[:, :t] = host.group_slot_mappings
        staged[:, t:num_tokens] = -1

    def load_inputs(
        self,
        desc: BatchDescriptor,
        host: HostInputs,
        intermediate_tensors: IntermediateTensors | None,
    ) -> None:
        """Write the step's inputs into the static buffers, padded to
        ``desc``, and upload them (one copy).

        Request-level buffers are padded to ``desc.num_reqs`` (FULL graphs);
        PIECEWISE attention runs eagerly on the exact requests."""
        n, t = desc.num_tokens, host.num_tokens
        num_reqs = desc.num_reqs if desc.num_reqs is not None else host.num_reqs
        staged = self.inputs.host
        _write_padded(staged["input_ids"], host.input_ids, n, 0)
        _write_padded(staged["positions"], host.positions, n, 0)
        _write_padded(staged["slot_mapping"], host.slot_mapping, n, -1)
        self._stage_group_slots(host, n)
        _write_padded(staged["query_start_loc"], host.query_start_loc, num_reqs + 1, t)
        _write_padded(staged["seq_lens"], host.seq_lens, num_reqs, 0)
        self._stage_block_table(host)
        self.inputs.upload("block_table", host.num_reqs)
        if intermediate_tensors is not None:
            rows = self._rows(n)
            for key, buffer in self._received.items():
                received = intermediate_tensors[key]
                buffer[: received.shape[0]].copy_(received, non_blocking=True)
                buffer[received.shape[0] : rows].zero_()

    def _stage_block_table(self, host: HostInputs) -> None:
        """The step's block table rows (every group's) into the staged one.
        A small table of one group whole (one copy costs less than finding
        the rows); a large one (long contexts), or one of several groups
        (their columns are strided in the source), only the rows changed
        since it was last staged from the same table (a steady decode step:
        none, or the few that got a new block), else every row up to the
        most blocks a row has (no kernel reads past a row's blocks)."""
        staged = self.inputs.host["block_table"]
        source, r = host.block_table_source, host.num_reqs
        small = self.num_kv_groups == 1 and r * staged.shape[1] <= _SMALL_BLOCK_TABLE
        if source is None or small:
            b = self.max_blocks_per_req
            for g, table in enumerate([host.block_table, *host.group_block_tables]):
                staged[:r, g * b : g * b + table.shape[1]] = table
            self._staged_block_table = None
            return
        changed = source.take_dirty_rows(r)
        if source is self._staged_block_table:
            if changed:
                self._write_group_major(changed, source.block_table_np[changed])
            return
        groups = self.num_kv_groups
        blocks = int(source.num_blocks_per_row[:r].max()) if r else 0
        blocks = -(-blocks // groups) * groups  # whole blocks of every group
        self._write_group_major(slice(0, r), source.block_table_np[:r, :blocks])
        self._staged_block_table = source

    def _write_group_major(self, rows: list[int] | slice, interleaved: np.ndarray) -> None:
        """Staged block table ``rows`` from a :class:`BlockTable`'s rows,
        whose groups' block ids are interleaved (group ``g``'s block ``i`` at
        column ``i * groups + g``): each group's to its own columns."""
        groups = self.num_kv_groups
        per_group = interleaved.shape[1] // groups
        by_group = interleaved.reshape(-1, per_group, groups).transpose(0, 2, 1)
        self._staged_groups[rows, :, :per_group] = by_group

    def input_views(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[:num_tokens], self.positions[:num_tokens]

    def eager_meta(
        self, host: HostInputs, num_tokens: int, meta: AttentionMetadata
    ) -> AttentionMetadata:
        """``meta`` (the step's exact metadata) with its device tensors
        pointing at the static buffers, for PIECEWISE attention."""
        r = host.num_reqs
        meta.query_start_loc = self.query_start_loc[: r + 1]
        meta.seq_lens = self.seq_lens[:r]
        meta.block_table = self.block_table[:r]
        meta.slot_mapping = self.slot_mapping[:num_tokens]
        meta.positions = self.positions[:num_tokens]
        meta.kv_groups = self._group_metas(meta, r, num_tokens)
        return meta

    # -- replay -------------------------------------------------------------

    def computes_logits(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> bool:
        """:meth:`run` of ``(mode, desc)`` returns logits, not hidden states."""
        return mode is CUDAGraphMode.FULL and desc in self.logits_graphs

    def greedy_ids(self, mode: CUDAGraphMode, desc: BatchDescriptor) -> torch.Tensor | None:
        """The argmax per token row that :meth:`run` of ``(mode, desc)``
        writes, or None when that graph writes none."""
        if self.greedy is None or mode is not CUDAGraphMode.FULL or desc not in self.greedy_graphs:
            return None
        return self.greedy.ids[: desc.num_tokens]

    def run(
        self, mode: CUDAGraphMode, desc: BatchDescriptor, meta: AttentionMetadata | None
    ) -> StageOutput:
        """Replay the graph(s) of ``desc`` on the loaded inputs: hidden
        states, intermediate tensors, or logits (:meth:`computes_logits`).
        Intermediate tensors are cloned: the next replay overwrites the
        graph's outputs while the pipeline send may still read them; logits
        are not (the sampler reads them before the next replay)."""
        if mode is CUDAGraphMode.FULL:
            out = self.full_graphs[desc].replay()
        else:
            assert meta is not None, "PIECEWISE attention needs the step's metadata"
            out = self._replay_pieces(desc, meta)
        if isinstance(out, IntermediateTensors):
            return IntermediateTensors({k: v.clone() for k, v in out.tensors.items()})
        return out

    def _replay_pieces(self, desc: BatchDescriptor, meta: AttentionMetadata) -> StageOutput:
        graphs = self.piecewise_graphs[desc]
        cut = self._cut_views(desc.num_tokens)
        for graph, layer in zip(graphs, self.layers, strict=False):
            graph.replay()
            cut.attn_out.copy_(layer.self_attn.attn(cut.q, cut.k, cut.v, meta))
        out = graphs[-1].replay()
        assert out is not None
        return out

    # -- capture ------------------------------------------------------------

    def capture(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Capture every dispatcher key, largest first, into the shared pool."""
        keys = self.dispatcher.keys_to_capture()
        for i, (mode, desc) in enumerate(keys):
            if mode is CUDAGraphMode.FULL:
                self._capture_full(desc)
            else:
                self._capture_pieces(desc)
            if progress is not None:
                progress(i + 1, len(keys))

    def _intermediate(self, num_tokens: int) -> IntermediateTensors | None:
        if self.model.model.is_first_stage:
            return None
        rows = self._rows(num_tokens)
        return IntermediateTensors({k: v[:rows] for k, v in self._received.items()})

    def _capture_full(self, desc: BatchDescriptor) -> None:
        n = desc.num_tokens
        assert desc.num_reqs is not None
        meta = self._static_meta(desc, desc.num_reqs, n)
        ids, positions = self.input_views(n)
        intermediate = self._intermediate(n)

        with_logits = desc.uniform_decode and self.model.lm_head is not None

        def forward() -> StageOutput:
            out = self.model(ids, positions, meta, intermediate)
            if with_logits:
                assert isinstance(out, torch.Tensor)
                return self.model.compute_logits(out)
            return out

        self.full_graphs[desc] = capture_graph(self._with_greedy(forward, desc), self.pool)
        if with_logits:
            self.logits_graphs.add(desc)

    def _with_greedy(
        self, forward: Callable[[], StageOutput], desc: BatchDescriptor
    ) -> Callable[[], StageOutput]:
        """``forward`` of a FULL graph, ending with its logits' argmax when
        it is a one-token decode graph to the logits and ``greedy_in_graph``
        is on."""
        greedy = self.greedy
        one_token = desc.uniform_decode and desc.num_tokens == desc.num_reqs
        if greedy is None or not one_token or self.model.lm_head is None:
            return forward
        self.greedy_graphs.add(desc)

        def logits() -> torch.Tensor:
            out = forward()
            assert isinstance(out, torch.Tensor)
            return out

        return greedy.wrap(logits, desc.num_tokens)

    def _cut_views(self, num_tokens: int) -> _Cut:
        b, rows = self._cut_buffers, self._rows(num_tokens)
        return _Cut(
            b.q[:num_tokens],
            b.k[:num_tokens],
            b.v[:num_tokens],
            b.attn_out[:num_tokens],
            b.residual[:rows],
        )

    def _capture_pieces(self, desc: BatchDescriptor) -> None:
        n = desc.num_tokens
        cut = self._cut_views(n)
        ids, positions = self.input_views(n)
        intermediate = self._intermediate(n)
        model = self.model.model

        def piece(i: int) -> StageOutput | None:
            if i == 0:
                hidden, residual = model.begin(ids, intermediate)
            else:
                hidden, residual = self.layers[i - 1].post_attention(cut.attn_out, cut.residual)
            if i == len(self.layers):
                return model.finish(hidden, residual)
            cos_sin = model.rotary.cos_sin(positions, self.dtype)
            q, k, v, residual = self.layers[i].pre_attention(cos_sin, hidden, residual)
            for dst, src in ((cut.q, q), (cut.k, k), (cut.v, v), (cut.residual, residual)):
                dst.copy_(src)
            return None

        self.piecewise_graphs[desc] = [
            capture_graph(functools.partial(piece, i), self.pool)
            for i in range(len(self.layers) + 1)
        ]

    def release(self) -> None:
        """Drop every graph (their pool memory goes back to the allocator)."""
        self.full_graphs.clear()
        self.logits_graphs.clear()
        self.greedy_graphs.clear()
        self.piecewise_graphs.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def num_graphs(self) -> int:
        return len(self.full_graphs) + sum(len(g) for g in self.piecewise_graphs.values())


#: Block table entries up to which the whole table is staged every step.
_SMALL_BLOCK_TABLE = 16384


def _write_padded(dst: np.ndarray, values: np.ndarray, length: int, pad: int) -> None:
    """``dst[:length]`` = ``values`` followed by ``pad``."""
    n = len(values)
    dst[:n] = values
    if n < length:
        dst[n:length] = pad
