"""The draft model of ``draft_model`` speculation: a smaller checkpoint of
the target's vocabulary, on the target's rank, proposing each speculating
request's next ``k`` tokens after every step (vLLM's draft-model proposer).

Its KV cache has the target's layout: the same number of blocks, the same
block ids, slots and block tables, so the scheduler's allocation, prefix
caching and preemption cover both models at once. The invariant: wherever
the target's cache holds a token's keys and values, the draft's holds that
token's too. :meth:`DraftModel.mirror` keeps it: every step the draft runs
over the target's step inputs (its attention metadata reused), rejected
drafts included (their slots are written again, by both models, when those
positions are next computed).

:meth:`DraftModel.propose` runs after the step's sampling: ``k`` passes of
one token per proposing request; the first feeds the step's last output
token at its position, each next one the draft's own greedy pick one
position further. Their keys and values go to the *lookahead* slots the
scheduler allocated past the step's tokens; a request whose blocks end
sooner gets fewer drafts. Drafts are greedy (argmax): the rejection sampler
treats a draft as drawn with probability one, which keeps a sampled
request's output distribution the target's.

May import torch, numpy, the model and its layers, ``asyncstep.datatypes``
and the runner's ``input_batch`` / ``step_inputs`` / ``step_state``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.ops.attention import AttentionMetadata, plan_decode_buckets
from asyncstep.runner.input_batch import InputBatch
from asyncstep.runner.step_inputs import StepInputs
from asyncstep.runner.step_state import ExecuteModelState

__all__ = ["DraftModel"]


@dataclass(frozen=True)
class _Proposing:
    """The requests one :meth:`DraftModel.propose` serves, as arrays."""

    req_ids: list[str]
    rows: np.ndarray  # their batch rows
    tokens: np.ndarray  # each one's last output token (the first pass's input)
    positions: np.ndarray  # that token's position
    num_drafts: np.ndarray  # drafts each gets (its lookahead slots allow)


class DraftModel:
    """The draft model, its KV cache and its two calls per step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        device: torch.device,
        num_speculative_tokens: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str,
        disable_by_batch_size: int | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.num_speculative_tokens = num_speculative_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.attention_backend = attention_backend
        self.disable_by_batch_size = disable_by_batch_size
        self.kv_caches: list[torch.Tensor] = []

    def kv_cache_block_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one KV block of the draft takes over its layers."""
        layers = self.model.attention_layers()
        per_layer = 2 * layers[0].num_kv_heads * layers[0].head_dim
        return per_layer * len(layers) * self.block_size * dtype.itemsize

    def mirror(self, inputs: StepInputs) -> None:
        """Write the draft's keys and values of the step's tokens (the
        target's inputs, its attention metadata reused; no logits)."""
        meta = inputs.attn_metadata
        if meta is None:
            raise RuntimeError(
                "the draft model needs the step's attention metadata: a FULL CUDA graph "
                "step has none (draft_model runs with cudagraph_mode none or piecewise)"
            )
        self.model(inputs.input_ids, inputs.positions, meta, None)

    def propose(
        self,
        batch: InputBatch,
        state: ExecuteModelState,
        output_tokens: list[list[int]],
    ) -> dict[str, list[int]]:
        """Draft tokens to follow each speculating sample row's output
        (``output_tokens``: the step's tokens per sample row, in
        ``state.sample_rows`` order), by request id; none for a request
        whose blocks have no lookahead slot."""
        if self.disable_by_batch_size is not None and (
            len(state.req_ids) >= self.disable_by_batch_size
        ):
            return {}
        proposing = self._proposing(batch, state, output_tokens)
        if proposing is None:
            return {}
        drafts = np.zeros((len(proposing.rows), self.num_speculative_tokens), dtype=np.int64)
        tokens = proposing.tokens
        for j in range(int(proposing.num_drafts.max())):
            alive = np.flatnonzero(proposing.num_drafts > j)
            picks = self._pass(
                batch, proposing.rows[alive], tokens[alive], proposing.positions[alive] + j
            )
            drafts[alive, j] = picks
            tokens = drafts[:, j].copy()
        return {
            req_id: drafts[i, : proposing.num_drafts[i]].tolist()
            for i, req_id in enumerate(proposing.req_ids)
        }

    def _proposing(
        self, batch: InputBatch, state: ExecuteModelState, output_tokens: list[list[int]]
    ) -> _Proposing | None:
        """The sample rows that speculate and have a lookahead slot."""
        scheduled = state.scheduler_output.num_scheduled_tokens
        spec = state.spec_decode_metadata
        num_drafts_in = spec.num_draft_tokens if spec is not None else [0] * len(state.sample_rows)
        k = self.num_speculative_tokens
        req_ids: list[str] = []
        rows, tokens, positions, counts = [], [], [], []
        table = batch.block_table
        for row, step_drafts, out in zip(
            state.sample_rows, num_drafts_in, output_tokens, strict=True
        ):
            params = batch.sampling_params[row]
            if not out or params is None or not params.speculates:
                continue
            req_id = state.req_ids[row]
            # The step's tokens start at the computed count; its last known
            # token precedes its drafts; the accepted drafts follow it, then
            # the output's last token.
            position = (
                int(batch.num_computed_tokens_cpu[row])
                + scheduled[req_id]
                - step_drafts
                + len(out)
                - 1
            )
            capacity = min(int(table.num_blocks_per_row[row]) * self.block_size, self.max_model_len)
            n = min(k, capacity - position)
            if n <= 0:
                continue
            req_ids.append(req_id)
            rows.append(row)
            tokens.append(out[-1])
            positions.append(position)
            counts.append(n)
        if not rows:
            return None
        return _Proposing(
            req_ids,
            np.asarray(rows, dtype=np.int64),
            np.asarray(tokens, dtype=np.int64),
            np.asarray(positions, dtype=np.int64),
            np.asarray(counts, dtype=np.int64),
        )

    def _pass(
        self, batch: InputBatch, rows: np.ndarray, tokens: np.ndarray, positions: np.ndarray
    ) -> np.ndarray:
        """One token per request at ``positions``: writes its keys and values,
        returns the draft's greedy next token of each."""
        meta = self._decode_metadata(batch, rows, positions, self.device)
        input_ids = torch.from_numpy(tokens).to(self.device)
        hidden = self.model(input_ids, meta.positions, meta, None)
        assert isinstance(hidden, torch.Tensor)
        logits = self.model.compute_logits(hidden)
        picks: np.ndarray = logits.argmax(dim=-1).cpu().numpy()
        return picks

    def _decode_metadata(
        self, batch: InputBatch, rows: np.ndarray, positions: np.ndarray, device: torch.device
    ) -> AttentionMetadata:
        """Attention metadata of a step of one query token per request."""
        size = self.block_size
        table = batch.block_table.block_table_np
        seq_lens = (positions + 1).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        num_blocks = -(-max_seq_len // size)
        block_table = np.ascontiguousarray(table[rows, :num_blocks])
        slots = table[rows, positions // size].astype(np.int64) * size + positions % size
        query_start_loc = np.arange(len(rows) + 1, dtype=np.int32)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        meta = AttentionMetadata(
            num_actual_tokens=len(rows),
            num_decodes=len(rows),
            query_start_loc=to_device(query_start_loc),
            seq_lens=to_device(seq_lens),
            block_table=to_device(block_table),
            slot_mapping=to_device(slots),
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            positions=to_device(positions),
        )
        if self.attention_backend == "torch":
            meta.decode_buckets = plan_decode_buckets(seq_lens, meta.block_table, size)
        return meta
