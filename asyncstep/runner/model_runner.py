"""The model runner: one step of the model on this rank, vLLM v1's two-phase
contract.

``execute_model(scheduler_output)`` updates the persistent batch, prepares
the step's inputs (input ids, positions, query_start_loc, seq_lens, slot
mapping, attention metadata), runs the forward and keeps an
:class:`ExecuteModelState`; it returns None (last pipeline stage),
``IntermediateTensors`` (other stages) or, for a step with no tokens, the
empty output at once. ``sample_tokens()`` then samples from the kept logits
and returns the :class:`ModelRunnerOutput`. Calling ``execute_model`` twice
without ``sample_tokens`` in between is an error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.datatypes import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    IntermediateTensors,
    Logprobs,
    ModelRunnerOutput,
    SchedulerOutput,
)
from asyncstep.models.layers.attention import (
    BLOCK_DIM,
    AttentionMetadata,
    kv_cache_shape,
    plan_decode_buckets,
)
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.runner.input_batch import CachedRequestState, InputBatch
from asyncstep.runner.sampler import Sampler

REENTRY_ERROR = "sample_tokens() must be called after execute_model() returns None"


@dataclass
class StepInputs:
    """The device inputs of one step, and where to read logits from."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    #: Token index of each sampling request's last token.
    logits_indices: torch.Tensor
    #: Batch rows that sample this step (their whole known sequence is computed).
    sample_rows: list[int]


@dataclass
class ExecuteModelState:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    scheduler_output: SchedulerOutput
    req_ids: list[str]
    logits: torch.Tensor  # [len(sample_rows), vocab]
    sample_rows: list[int]


@dataclass
class StepTimings:
    """Host seconds spent in the phases of the last step."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        max_num_reqs: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.device, self.dtype = device, dtype
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(max_num_reqs, max_model_len, block_size, device)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.execute_model_state: ExecuteModelState | None = None
        self.timings = StepTimings()
        self.is_last_stage = model.lm_head is not None
        #: Sequence parallelism splits a step's tokens over the TP group: the
        #: step is padded to a multiple of tp_size (1 otherwise: no padding).
        self.num_tokens_multiple = model.num_tokens_multiple

    # -- KV cache ---------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_caches[0].shape[BLOCK_DIM] if self.kv_caches else 0

    def kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes over all of this rank's layers."""
        layers = self.model.attention_layers()
        per_layer = sum(2 * a.num_kv_heads * a.head_dim for a in layers[:1])
        return per_layer * len(layers) * self.block_size * self.dtype.itemsize

    def free_kv_cache(self) -> None:
        """Drop the KV cache (the engine closed): its memory goes back to the device."""
        for attn in self.model.attention_layers():
            attn.kv_cache = torch.empty(0)
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's paged cache and bind it to its attention layer."""
        self.kv_caches = []
        for attn in self.model.attention_layers():
            cache = torch.zeros(
                kv_cache_shape(num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim),
                dtype=self.dtype,
                device=self.device,
            )
            attn.kv_cache = cache
            self.kv_caches.append(cache)

    # -- the step ---------------------------------------------------------

    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        if self.execute_model_state is not None:
            raise RuntimeError(REENTRY_ERROR)
        t0 = time.perf_counter()
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.timings = StepTimings()
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs = self._prepare_inputs(scheduler_output)
        t1 = time.perf_counter()
        out = self.model(
            inputs.input_ids, inputs.positions, inputs.attn_metadata, intermediate_tensors
        )
        if isinstance(out, IntermediateTensors):
            self.timings = StepTimings(prepare=t1 - t0, forward=time.perf_counter() - t1)
            return out
        logits = self.model.compute_logits(out[inputs.logits_indices])
        self.execute_model_state = ExecuteModelState(
            scheduler_output, self.input_batch.req_ids, logits, inputs.sample_rows
        )
        self.timings = StepTimings(prepare=t1 - t0, forward=time.perf_counter() - t1)
        return None

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        state = self.execute_model_state
        if state is None:
            raise RuntimeError("sample_tokens() called without a pending execute_model()")
        self.execute_model_state = None
        t0 = time.perf_counter()
        sampled_token_ids: list[list[int]] = [[] for _ in state.req_ids]
        logprobs: list[list[Logprobs]] | None = None
        if state.sample_rows:
            metadata = self.input_batch.sampling_metadata(state.sample_rows)
            result = self.sampler(state.logits, metadata)
            tokens = result.sampled_token_ids.tolist()
            for row, token in zip(state.sample_rows, tokens, strict=True):
                sampled_token_ids[row] = [token]
                self._append_token(state.req_ids[row], row, token)
            if result.logprobs_tensors is not None:
                logprobs = self._logprobs_lists(state, result.logprobs_tensors.tolists())
        self.timings.sample = time.perf_counter() - t0
        return ModelRunnerOutput(
            req_ids=state.req_ids,
            req_id_to_index={r: i for i, r in enumerate(state.req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
        )

    # -- persistent batch -------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        # Requests not in this step (preempted, or waiting for budget) leave the
        # batch but keep their state here.
        for req_id in list(batch.req_id_to_index):
            if req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._update_cached(
                self.requests[req_id],
                resumed=cached.resumed_from_preemption[i],
                new_block_ids=cached.new_block_ids[i],
                new_token_ids=cached.new_token_ids[i] if cached.new_token_ids else [],
                num_computed_tokens=cached.num_computed_tokens[i],
            )
        for req_id in so.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                batch.add_request(self.requests[req_id])
        batch.condense()
        batch.reorder_decodes_first(so.num_scheduled_tokens)

    def _update_cached(
        self,
        state: CachedRequestState,
        *,
        resumed: bool,
        new_block_ids: list[int],
        new_token_ids: list[int],
        num_computed_tokens: int,
    ) -> None:
        state.num_computed_tokens = num_computed_tokens
        if self.is_last_stage:
            new_token_ids = []  # this stage sampled them itself
        # Tokens sampled by the last pipeline stage, which this stage needs as inputs.
        state.output_token_ids.extend(new_token_ids)
        if resumed:
            state.block_ids = list(new_block_ids)
        else:
            state.block_ids.extend(new_block_ids)
        if resumed:  # its row (if any) is stale: re-add it whole
            self.input_batch.remove_request(state.req_id)
        row = self.input_batch.req_id_to_index.get(state.req_id)
        if row is None:
            return  # (re-)added whole by _update_states
        self.input_batch.num_computed_tokens_cpu[row] = num_computed_tokens
        for token in new_token_ids:
            self.input_batch.append_token(row, token)
        self.input_batch.block_table.append_row(new_block_ids, row)

    def _append_token(self, req_id: str, row: int, token: int) -> None:
        self.requests[req_id].output_token_ids.append(token)
        self.input_batch.append_token(row, token)

    # -- inputs -----------------------------------------------------------

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_sched = np.array([so.num_scheduled_tokens[r] for r in batch.req_ids], dtype=np.int64)
        cu_num_tokens = np.cumsum(num_sched)
        total = int(cu_num_tokens[-1])
        num_input_tokens = -(-total // self.num_tokens_multiple) * self.num_tokens_multiple
        req_indices = np.repeat(np.arange(num_reqs), num_sched)
        offsets = np.arange(total) - np.repeat(cu_num_tokens - num_sched, num_sched)
        computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = computed[req_indices] + offsets
        input_ids = batch.token_ids_cpu.ravel()[req_indices * batch.max_model_len + positions]
        seq_lens = computed + num_sched
        query_start_loc = np.concatenate([[0], cu_num_tokens]).astype(np.int32)
        slot_mapping = batch.block_table.compute_slot_mapping(req_indices, positions)
        # A request samples once every token it has is in the cache.
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs]).tolist()
        max_seq_len = int(seq_lens.max())
        num_decodes = int((num_sched == 1).sum())
        block_table = batch.block_table.commit(num_reqs, -(-max_seq_len // self.block_size))
        attn_metadata = AttentionMetadata(
            num_actual_tokens=total,
            num_decodes=num_decodes,
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_table=block_table,
            slot_mapping=self._to_device(_pad(slot_mapping, num_input_tokens, -1)),
            max_query_len=int(num_sched.max()),
            max_seq_len=max_seq_len,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            decode_buckets=plan_decode_buckets(
                seq_lens[:num_decodes], block_table[:num_decodes], self.block_size
            ),
        )
        # Padding tokens (id 0, position 0, slot -1) come after the real ones.
        return StepInputs(
            input_ids=self._to_device(_pad(input_ids.astype(np.int64), num_input_tokens, 0)),
            positions=self._to_device(_pad(positions, num_input_tokens, 0)),
            attn_metadata=attn_metadata,
            logits_indices=self._to_device(cu_num_tokens[sample_rows] - 1),
            sample_rows=sample_rows,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)

    def _logprobs_lists(
        self, state: ExecuteModelState, rows: list[Logprobs]
    ) -> list[list[Logprobs]]:
        out: list[list[Logprobs]] = [[] for _ in state.req_ids]
        for row, lp in zip(state.sample_rows, rows, strict=True):
            n = self.input_batch.sampling_params[row].logprobs  # type: ignore[union-attr]
            if n is not None:
                out[row] = [
                    Logprobs(lp.token_ids[: n + 1], lp.logprobs[: n + 1], lp.sampled_token_rank)
                ]
        return out


def _pad(array: np.ndarray, length: int, value: int) -> np.ndarray:
    """``array`` followed by ``value`` up to ``length`` entries."""
    if len(array) == length:
        return array
    return np.pad(array, (0, length - len(array)), constant_values=value)
