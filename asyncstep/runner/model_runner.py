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

With ``async_scheduling`` the runner never waits for the device between
steps. ``sample_tokens()`` enqueues the sampler and returns an
:class:`AsyncModelRunnerOutput` (the ids are copied to pinned host memory on
a copy stream); the sampled ids stay on the device, and the next step, which
the scheduler built before it knew them (output placeholders), scatters
them into its input ids. The host learns the tokens when a later step starts
(``_resolve_outputs``: by then the copy has long landed), and appends them to
the persistent batch. Inputs go to the device through pinned staging buffers
guarded by ``prepare_inputs_event`` (:mod:`asyncstep.runner.staging`).

A step spends little Python per request (``fast_paths``; off, the runner
goes request by request, which tests compare): ``_update_states`` writes the
computed counts of the requests that keep their rows with one array
assignment and touches only those that got a new block, joined, left or
resumed (a request's row, not its state, holds its tokens while it has
one: see :class:`CachedRequestState`); the sampled tokens are appended with
a few array operations (at the rows the requests hold now). The steady
decode step (the same requests in the same rows as the step before, one
token each; :attr:`InputBatch.layout_version` tells when rows moved) also
copies the previous step's ids into the input ids without a gather and
samples with the last step's metadata; its inputs take the decode path of
:mod:`asyncstep.runner.step_inputs`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.config import CompilationConfig
from asyncstep.datatypes import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    CachedRequestData,
    GrammarOutput,
    IntermediateTensors,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from asyncstep.gpu.stream import StreamEvent, record_event
from asyncstep.logging.spans import tracing
from asyncstep.models.layers.attention import (
    BLOCK_DIM,
    Attention,
    kv_cache_shape,
    reference_attention_backends,
)
from asyncstep.models.layers.norm import RMSNorm
from asyncstep.models.llama import LlamaForCausalLM, LlamaMLP
from asyncstep.runner.async_output import AsyncModelRunnerOutput, copy_to_host, host_logprobs
from asyncstep.runner.attention_backend import (
    resolve_attention_backend,
    resolve_cudagraph_mode,
)
from asyncstep.runner.cudagraph_dispatcher import (
    CudagraphDispatcher,
    CUDAGraphMode,
)
from asyncstep.runner.cudagraph_runner import CudaGraphRunner
from asyncstep.runner.grammar_bitmask import GrammarBitmask
from asyncstep.runner.input_batch import CachedRequestState, InputBatch
from asyncstep.runner.logits_processing import LogitsProcessing, TokenHistory
from asyncstep.runner.prompt_logprobs import HostPromptLogprobs, PromptLogprobsTracker
from asyncstep.runner.sampler import Sampler
from asyncstep.runner.staging import StagingBuffers
from asyncstep.runner.step_inputs import StepInputBuilder, StepInputs, is_arange
from asyncstep.runner.ubatch_forward import forward_ubatches

REENTRY_ERROR = "sample_tokens() must be called after execute_model() returns None"
#: Up to this many sampled rows, tokens are appended one by one.
_FEW_ROWS = 32


@dataclass
class StepEvents:
    """Device events of one step (recorded only while tracing or when asked):
    the forward's start and end, and the end of sampling + the host copy."""

    forward_start: StreamEvent
    forward_end: StreamEvent
    copy_end: StreamEvent | None = None


@dataclass
class ExecuteModelState:
    """What ``execute_model`` leaves for ``sample_tokens``."""

    scheduler_output: SchedulerOutput
    req_ids: list[str]
    logits: torch.Tensor  # [len(sample_rows), vocab]
    sample_rows: list[int]
    events: StepEvents | None = None
    #: The step's input ids and each sample row's last token index among
    #: them (the logits processing reads the newest tokens there).
    input_ids: torch.Tensor | None = None
    logits_indices: torch.Tensor | slice | None = None
    #: The step's prompt log-probs on their way to the host (a request asked).
    prompt_logprobs: HostPromptLogprobs | None = None


@dataclass
class _SampledFrom:
    """Where a step's sampled ids came from: its batch, the batch's layout
    then, the row of each sampled id, and the rows' request ids."""

    batch: InputBatch
    layout_version: int
    rows: list[int]
    req_ids: list[str]

    def still_in_place(self) -> bool:
        """Whether every row still holds the request it held then."""
        return self.batch.layout_version == self.layout_version

    def all_rows(self) -> bool:
        """Whether every row of the batch sampled (rows are 0, 1, ...)."""
        return len(self.rows) == len(self.req_ids)

    def index(self) -> dict[str, int]:
        """Request id -> its id's index in the sampled ids."""
        ids = map(self.req_ids.__getitem__, self.rows)
        return dict(zip(ids, range(len(self.rows)), strict=True))


@dataclass
class StepTimings:
    """Host seconds spent in the phases of the last step."""

    prepare: float = 0.0
    #: The launch: the forward call, the logits and the step's events.
    forward: float = 0.0
    sample: float = 0.0
    #: Of ``forward``, the forward call alone (a graph replay, or the eager forward).
    replay: float = 0.0
    #: Of ``sample``, applying the grammar bitmask.
    grammar: float = 0.0


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
        async_scheduling: bool = False,
        compilation: CompilationConfig | None = None,
        max_num_batched_tokens: int = 2048,
        graph_stand_in: bool = False,
        num_input_batches: int = 1,
    ) -> None:
        """``graph_stand_in``: run CUDA-graph modes without CUDA (graphs
        replayed by calling the captured function again), to test the
        graph wiring on the CPU; otherwise the CPU runs eagerly.

        ``num_input_batches``: persistent batches kept (pipeline parallelism:
        one per step in flight, whose requests differ, so alternating steps
        do not rebuild every row each step)."""
        self.model = model
        self.device, self.dtype = device, dtype
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.requests: dict[str, CachedRequestState] = {}
        if num_input_batches < 1:
            raise ValueError(f"num_input_batches must be >= 1, got {num_input_batches}")
        self.input_batches = [
            InputBatch(max_num_reqs, max_model_len, block_size, device)
            for _ in range(num_input_batches)
        ]
        #: The persistent batch of the current step.
        self.input_batch = self.input_batches[0]
        self.sampler = Sampler()
        self.prompt_logprobs = PromptLogprobsTracker(enabled=model.lm_head is not None)
        self.kv_caches: list[torch.Tensor] = []
        self.execute_model_state: ExecuteModelState | None = None
        self.timings = StepTimings()
        self.is_last_stage = model.lm_head is not None
        #: Sequence parallelism splits a step's tokens over the TP group: the
        #: step is padded to a multiple of tp_size (1 otherwise: no padding).
        self.num_tokens_multiple = model.num_tokens_multiple
        self.async_scheduling = async_scheduling
        self.staging = StagingBuffers(device)
        self._grammar_bitmask: GrammarBitmask | None = None  # built by the first grammar
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: The last sampled ids, still on the device, and whose they are.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sampled_from: _SampledFrom | None = None
        #: Sampled outputs whose tokens the persistent batch does not hold yet.
        self._unresolved: deque[tuple[AsyncModelRunnerOutput, _SampledFrom | None]] = deque()
        #: The last steady step's cached request ids and their rows (None:
        #: row i is request i), valid while the batch's layout is the same.
        self._steady_rows: tuple[InputBatch, int, list[str], np.ndarray | None] | None = None
        #: Record device events for step timelines even when not tracing (benchmarks).
        self.record_step_events = False
        #: The events of the last step that ran a forward.
        self.last_step_events: StepEvents | None = None
        compilation = compilation or CompilationConfig()
        self.attention_backend = resolve_attention_backend(compilation.attention_backend, device)
        for attn in model.attention_layers():
            attn.backend = self.attention_backend
        self.fused_kernels = compilation.fused_kernels and self.attention_backend == "triton"
        _use_fused_kernels(model, self.fused_kernels)
        mode = resolve_cudagraph_mode(
            compilation.cudagraph_mode, device, self.attention_backend, graph_stand_in
        )
        self.dispatcher = CudagraphDispatcher(
            mode,
            max_num_seqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            capture_sizes=compilation.cudagraph_capture_sizes,
            max_capture_size=compilation.max_cudagraph_capture_size,
            num_tokens_multiple=self.num_tokens_multiple,
        )
        self._graph_stand_in = graph_stand_in
        self._ubatch_stream: torch.cuda.Stream | None = None
        self.graph_runner: CudaGraphRunner | None = None
        self.step_inputs = StepInputBuilder(
            self.input_batch,
            self.staging,
            self.dispatcher,
            compilation,
            block_size=block_size,
            attention_backend=self.attention_backend,
            num_tokens_multiple=self.num_tokens_multiple,
            sequence_parallel=model.sequence_parallel,
        )

    @property
    def fast_paths(self) -> bool:
        """Whether steps take the fast paths where they can (the steady
        decode step's; see the module doc). Off: every step the general
        path, which computes the same inputs (tests compare the two)."""
        return self.step_inputs.fast_paths

    @fast_paths.setter
    def fast_paths(self, enabled: bool) -> None:
        self.step_inputs.fast_paths = enabled
        for batch in self.input_batches:
            batch.cache_sampling_metadata = enabled

    # -- KV cache ---------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_caches[0].shape[BLOCK_DIM] if self.kv_caches else 0

    def kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes over all of this rank's layers."""
        layers = self.model.attention_layers()
        per_layer = sum(2 * a.num_kv_heads * a.head_dim for a in layers[:1])
        return per_layer * len(layers) * self.block_size * self.dtype.itemsize

    def capture_model(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Capture the CUDA graphs the dispatcher lists (after the KV cache
        is bound: graphs hold its address), largest first; returns how many."""
        if self.dispatcher.mode is CUDAGraphMode.NONE or not self.dispatcher.capture_sizes:
            return 0
        assert self.kv_caches, "initialize the KV cache before capturing graphs"
        self.graph_runner = CudaGraphRunner(
            self.model,
            self.dispatcher,
            device=self.device,
            dtype=self.dtype,
            max_num_reqs=self.input_batch.max_num_reqs,
            max_blocks_per_req=self.input_batch.block_table.max_num_blocks_per_req,
            stand_in=self._graph_stand_in,
        )
        self.step_inputs.graph_runner = self.graph_runner
        with torch.inference_mode(), reference_attention_backends():
            self.graph_runner.capture(progress)
        return self.graph_runner.num_graphs

    def free_kv_cache(self) -> None:
        """Drop the CUDA graphs and the KV cache (the engine closed): their
        memory goes back to the device."""
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = self.step_inputs.graph_runner = None
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
        """Run one step's forward (see the module doc)."""
        if self.execute_model_state is not None:
            raise RuntimeError(REENTRY_ERROR)
        t0 = time.perf_counter()
        self._resolve_outputs(keep_last=self.async_scheduling)
        self._select_input_batch(scheduler_output)
        self._update_states(scheduler_output)
        self.prompt_logprobs.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.timings = StepTimings()
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs = self.step_inputs.prepare(
            scheduler_output, intermediate_tensors, self._scatter_sampled
        )
        t1 = time.perf_counter()
        record = self.record_step_events or tracing()
        start = record_event(self.device) if record else None
        t2 = time.perf_counter()
        if self.attention_backend == "torch":
            with reference_attention_backends():
                out = self._forward(inputs, intermediate_tensors)
        else:
            out = self._forward(inputs, intermediate_tensors)
        replay = time.perf_counter() - t2
        prompt_lp = None
        if self.prompt_logprobs.owed and not isinstance(out, IntermediateTensors):
            logits_fn = None if self._graph_computed_logits(inputs) else self.model.compute_logits
            prompt_lp = self.prompt_logprobs.compute(
                scheduler_output, self.input_batch, out, logits_fn, self._copy_stream
            )
        if not isinstance(out, IntermediateTensors):
            if self._graph_computed_logits(inputs):
                out = out[inputs.logits_indices]
            else:
                out = self.model.compute_logits(out[inputs.logits_indices])
        events = StepEvents(start, record_event(self.device)) if start is not None else None

        self.last_step_events = events
        self.timings = StepTimings(prepare=t1 - t0, forward=time.perf_counter() - t1, replay=replay)
        if isinstance(out, IntermediateTensors):
            return out
        self.execute_model_state = ExecuteModelState(
            scheduler_output,
            self.input_batch.req_ids,
            out,
            inputs.sample_rows,
            events,
            inputs.input_ids,
            inputs.logits_indices,
            prompt_logprobs=prompt_lp,
        )
        return None

    def _graph_computed_logits(self, inputs: StepInputs) -> bool:
        return self.graph_runner is not None and self.graph_runner.computes_logits(
            inputs.cudagraph_mode, inputs.batch_descriptor
        )

    def _forward(
        self, inputs: StepInputs, intermediate_tensors: IntermediateTensors | None
    ) -> torch.Tensor | IntermediateTensors:
        if inputs.ubatches is not None:
            if self._ubatch_stream is None and self.device.type == "cuda":
                self._ubatch_stream = torch.cuda.Stream(self.device)
            return forward_ubatches(self.model, inputs.ubatches, self._ubatch_stream)
        if inputs.cudagraph_mode is CUDAGraphMode.NONE:
            assert inputs.attn_metadata is not None
            return self.model(
                inputs.input_ids, inputs.positions, inputs.attn_metadata, intermediate_tensors
            )
        assert self.graph_runner is not None
        return self.graph_runner.run(
            inputs.cudagraph_mode, inputs.batch_descriptor, inputs.attn_metadata
        )

    @torch.inference_mode()
    def sample_tokens(
        self, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample the kept logits, those of ``grammar_output``'s requests
        masked by their bitmask first. Synchronous runner: the output, the
        tokens appended to the batch. Async scheduling: an
        :class:`AsyncModelRunnerOutput` at once (the device still samples)."""
        state = self.execute_model_state
        if state is None:
            raise RuntimeError("sample_tokens() called without a pending execute_model()")
        self.execute_model_state = None
        t0 = time.perf_counter()
        if grammar_output is not None:
            rows = state.sample_rows
            row_of = dict(zip(map(state.req_ids.__getitem__, rows), range(len(rows)), strict=True))
            if self._grammar_bitmask is None:
                self._grammar_bitmask = GrammarBitmask(self.device)
            self._grammar_bitmask.apply(state.logits, grammar_output, row_of)
            self.timings.grammar = time.perf_counter() - t0
        output = self._sample(state)
        output.prompt_logprobs = state.prompt_logprobs
        if state.events is not None:
            state.events.copy_end = output.copy_event
        self.timings.sample = time.perf_counter() - t0
        if self.async_scheduling:
            self._unresolved.append((output, self._prev_sampled_from))
            return output
        self._apply_sampled(output, self._prev_sampled_from)
        return output.get_output()

    def _sample(self, state: ExecuteModelState) -> AsyncModelRunnerOutput:
        """Enqueue sampling and the copy of its result to the host."""
        rows = state.sample_rows
        if not rows:
            self._prev_sampled, self._prev_sampled_from = None, None
            empty = torch.empty(0, dtype=torch.int64)
            return AsyncModelRunnerOutput(state.req_ids, [], empty, record_event(None))
        batch = self.input_batch
        metadata = batch.sampling_metadata(rows)
        history = None
        if metadata.processing is not None:
            history = self._token_history(state, metadata.processing)
        result = self.sampler(state.logits, metadata, history)
        sampled = result.sampled_token_ids
        self._prev_sampled = sampled
        self._prev_sampled_from = _SampledFrom(batch, batch.layout_version, rows, state.req_ids)
        tensors = [sampled]
        lp = result.logprobs_tensors
        if lp is not None:
            tensors += [lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks]
        hosts, copy_event = copy_to_host(tensors, self._copy_stream)
        logprobs = None
        if lp is not None:
            asked = [self.input_batch.sampling_params[row].logprobs for row in rows]  # type: ignore[union-attr]
            logprobs = host_logprobs(hosts[1:], asked)
        return AsyncModelRunnerOutput(state.req_ids, rows, hosts[0], copy_event, logprobs)

    def _token_history(
        self, state: ExecuteModelState, processing: LogitsProcessing
    ) -> TokenHistory:
        """The tokens of the step's sampling rows that the logits processing
        reads: the host's, and the newest from the step's input ids (with
        async scheduling only the device knows it yet)."""
        rows = state.sample_rows
        scheduled, req_ids = state.scheduler_output.num_scheduled_tokens, state.req_ids
        num_sched = np.fromiter((scheduled[req_ids[row]] for row in rows), np.int64, len(rows))
        batch = self.input_batch
        seq_lens = batch.num_computed_tokens_cpu[rows].astype(np.int64) + num_sched
        last = None
        if processing.needs_token_ids:
            assert state.input_ids is not None and state.logits_indices is not None
            last = state.input_ids[state.logits_indices]
        return batch.token_history(rows, seq_lens, last, processing)

    def _resolve_outputs(self, *, keep_last: bool) -> None:
        """Append the tokens of sampled steps to the persistent batch; all of
        them, or all but the newest (whose ids the next step takes from the
        device, even when its copy has landed: one code path on every device).
        Blocks on a copy only if it has not landed yet."""
        keep = 1 if keep_last else 0
        while len(self._unresolved) > keep:
            self._apply_sampled(*self._unresolved.popleft())

    def _apply_sampled(self, output: AsyncModelRunnerOutput, origin: _SampledFrom | None) -> None:
        if self.fast_paths and origin is not None:
            if origin.still_in_place():
                self._append_in_place(output, origin)
                return
            if len(self.input_batches) == 1 and len(origin.rows) > _FEW_ROWS:
                self._append_moved(output, origin)
                return
        tokens = output.sampled_token_ids()
        for row, token in zip(output.sample_rows, tokens, strict=True):
            req_id = output.req_ids[row]
            state = self.requests.get(req_id)
            if state is None:
                continue  # finished meanwhile
            for batch in self.input_batches:  # a request is in one batch at most
                current_row = batch.req_id_to_index.get(req_id)
                if current_row is not None:
                    batch.append_token(current_row, token)
                    break
            else:
                state.output_token_ids.append(token)  # (its row, if any, has it)

    @staticmethod
    def _append_in_place(output: AsyncModelRunnerOutput, origin: _SampledFrom) -> None:
        """``_apply_sampled`` when no row changed hands since the sampling
        (no request left, so none finished meanwhile): each token to its
        row, all at once when there are many (a few array operations cost
        more than a few scalar ones)."""
        batch = origin.batch
        if len(origin.rows) <= _FEW_ROWS:
            for row, token in zip(origin.rows, output.sampled_token_ids(), strict=True):
                batch.append_token(row, token)
            return
        rows = None if origin.all_rows() else np.asarray(origin.rows)
        batch.append_tokens(rows, output.sampled_token_array())

    def _append_moved(self, output: AsyncModelRunnerOutput, origin: _SampledFrom) -> None:
        """``_apply_sampled`` with one persistent batch whose rows changed
        since the sampling: the tokens of the requests still in it at once
        (at their rows now), the others' to their states (a finished one's
        nowhere)."""
        batch = self.input_batch
        req_ids = [origin.req_ids[row] for row in origin.rows]
        rows = np.fromiter(
            map(batch.req_id_to_index.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids)
        )
        tokens = output.sampled_token_array()
        present = rows >= 0
        if present.all():
            batch.append_tokens(rows, tokens)
            return
        batch.append_tokens(rows[present], tokens[present])
        for i in np.flatnonzero(~present).tolist():
            state = self.requests.get(req_ids[i])
            if state is not None:
                state.output_token_ids.append(int(tokens[i]))

    # -- persistent batch -------------------------------------------------

    def _select_input_batch(self, so: SchedulerOutput) -> None:
        """The persistent batch holding most of this step's requests (an
        emptier one on a tie, e.g. a step of new requests)."""
        if len(self.input_batches) == 1:
            return
        scheduled = so.num_scheduled_tokens

        def fit(batch: InputBatch) -> tuple[int, int]:
            return sum(r in scheduled for r in batch.req_id_to_index), -batch.num_reqs

        self.input_batch = max(self.input_batches, key=fit)
        self.step_inputs.input_batch = self.input_batch

    def _remove_everywhere(self, req_id: str, *, finished: bool = False) -> None:
        for batch in self.input_batches:
            batch.remove_request(req_id, sync_state=not finished)

    def _update_states(self, so: SchedulerOutput) -> None:
        """The persistent batch from the step's diffs: finished requests
        dropped, requests not in this step out of the batch (preempted, or
        waiting for budget: their state stays), new ones in, the cached
        ones' counts, blocks and tokens updated, rows dense and decodes first."""
        batch = self.input_batch
        if not self.fast_paths:
            self._update_states_one_by_one(so)
            return
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._remove_everywhere(req_id, finished=True)
        scheduled, index = so.num_scheduled_tokens, batch.req_id_to_index
        same = len(scheduled) == len(index) and scheduled.keys() == index.keys()
        if not same:
            for req_id in index.keys() - scheduled.keys():
                batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self._add_state(new)
        self._update_cached_bulk(so.scheduled_cached_reqs)
        if len(index) != len(scheduled):  # (index holds only scheduled requests now)
            for req_id in [r for r in scheduled if r not in index]:
                self._remove_everywhere(req_id)  # a request lives in one batch
                batch.add_request(self.requests[req_id])
        batch.condense()
        if so.total_num_scheduled_tokens != batch.num_reqs:  # else: all decodes
            batch.reorder_decodes_first(scheduled)

    def _update_states_one_by_one(self, so: SchedulerOutput) -> None:
        """``_update_states`` request by request (``fast_paths`` off)."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._remove_everywhere(req_id, finished=True)
        for req_id in list(batch.req_id_to_index):
            if req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self._add_state(new)
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
                self._remove_everywhere(req_id)
                batch.add_request(self.requests[req_id])
        batch.condense()
        if so.total_num_scheduled_tokens != batch.num_reqs:
            batch.reorder_decodes_first(so.num_scheduled_tokens)

    def _add_state(self, new: NewRequestData) -> None:
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

    def _update_cached_bulk(self, cached: CachedRequestData) -> None:
        """``_update_cached`` of every cached request, at once for those in
        their row (not resumed; this stage samples, so no tokens to append):
        one array assignment of the computed counts, and Python only for the
        requests that got new blocks. The rest one by one."""
        req_ids = cached.req_ids
        num = len(req_ids)
        if num == 0:
            return
        rows: np.ndarray | None
        if not self.is_last_stage:  # tokens for every request: one by one
            rows = np.full(num, -1, dtype=np.int64)
        else:
            rows = self._cached_rows(req_ids)
        one_by_one = None if rows is None else rows < 0
        if any(cached.resumed_from_preemption):
            resumed = np.fromiter(cached.resumed_from_preemption, bool, num)
            one_by_one = resumed if one_by_one is None else one_by_one | resumed
        batch = self.input_batch
        computed = batch.num_computed_tokens_cpu
        new_block_ids = cached.new_block_ids
        if one_by_one is None or not one_by_one.any():  # every request in its row
            if rows is None:  # request i in row i
                computed[:num] = cached.num_computed_tokens
            else:
                computed[rows] = cached.num_computed_tokens
            if any(new_block_ids):
                self._append_blocks(cached, range(num), rows)
            return
        if rows is None:
            rows = np.arange(num)
        in_row = np.flatnonzero(~one_by_one)
        rows_in = rows[in_row]
        computed[rows_in] = np.asarray(cached.num_computed_tokens)[in_row]
        if any(new_block_ids):
            with_blocks = itertools.compress(range(num), new_block_ids)
            self._append_blocks(cached, [i for i in with_blocks if not one_by_one[i]], rows)
        for i in np.flatnonzero(one_by_one).tolist():
            self._update_cached(
                self.requests[req_ids[i]],
                resumed=cached.resumed_from_preemption[i],
                new_block_ids=new_block_ids[i],
                new_token_ids=cached.new_token_ids[i] if cached.new_token_ids else [],
                num_computed_tokens=cached.num_computed_tokens[i],
            )

    def _append_blocks(
        self, cached: CachedRequestData, which: Iterable[int], rows: np.ndarray | None
    ) -> None:
        """The new blocks of the cached requests ``which`` (indices into
        ``cached``), in their rows (None: request i in row i)."""
        new_block_ids, table = cached.new_block_ids, self.input_batch.block_table
        for i in itertools.compress(which, map(new_block_ids.__getitem__, which)):
            blocks = new_block_ids[i]
            self.requests[cached.req_ids[i]].block_ids.extend(blocks)
            table.append_row(blocks, i if rows is None else int(rows[i]))

    def _cached_rows(self, req_ids: list[str]) -> np.ndarray | None:
        """The batch row of each of ``req_ids`` (-1: not in the batch); None
        when request i is in row i. Remembered while the ids and the batch's
        layout stay the same (a steady step: no Python per request)."""
        batch = self.input_batch
        last = self._steady_rows
        if (
            last is not None
            and last[0] is batch
            and last[1] == batch.layout_version
            and last[2] == req_ids
        ):
            return last[3]
        rows = np.fromiter(
            map(batch.req_id_to_index.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids)
        )
        found = None if len(rows) == batch.num_reqs and is_arange(rows) else rows
        self._steady_rows = (batch, batch.layout_version, list(req_ids), found)
        return found

    def _update_cached(
        self,
        state: CachedRequestState,
        *,
        resumed: bool,
        new_block_ids: list[int],
        new_token_ids: list[int],
        num_computed_tokens: int,
    ) -> None:
        row = self.input_batch.req_id_to_index.get(state.req_id)
        if resumed or row is None:
            # Re-added whole by _update_states (a resumed request's row, if
            # any, is stale): first its state catches up with a row it has
            # in any batch, then takes this step's deltas.
            self._remove_everywhere(state.req_id)
            row = None
        state.num_computed_tokens = num_computed_tokens
        if self.is_last_stage:
            new_token_ids = []  # this stage sampled them itself
        # Tokens sampled by the last pipeline stage, which this stage needs as inputs.
        state.output_token_ids.extend(new_token_ids)
        if resumed:
            state.block_ids = list(new_block_ids)
        else:
            state.block_ids.extend(new_block_ids)
        if row is None:
            return
        self.input_batch.num_computed_tokens_cpu[row] = num_computed_tokens
        for token in new_token_ids:
            self.input_batch.append_token(row, token)
        self.input_batch.block_table.append_row(new_block_ids, row)

    # -- inputs -----------------------------------------------------------

    def _scatter_sampled(
        self,
        input_ids: torch.Tensor,
        seq_lens: np.ndarray,
        cu_num_tokens: np.ndarray,
    ) -> torch.Tensor:
        """Fill the tokens whose ids only the device knows (sampled by the
        previous step, async scheduling) from the sampled ids left there.
        Such a token is its request's last of this step."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        unknown = seq_lens > batch.num_tokens[:num_reqs]
        if not unknown.any():
            return input_ids
        origin, prev = self._prev_sampled_from, self._prev_sampled
        if (
            self.fast_paths
            and origin is not None
            and prev is not None
            and origin.batch is batch
            and origin.still_in_place()
            and origin.all_rows()
            and int(cu_num_tokens[-1]) == num_reqs
            and unknown.all()
        ):
            # Steady decode: the same requests in the same rows, one token each.
            input_ids[:num_reqs].copy_(prev[:num_reqs])
            return input_ids
        rows = np.flatnonzero(unknown)
        req_ids = list(map(batch.req_ids.__getitem__, rows.tolist()))
        index = origin.index() if origin is not None else {}
        src = np.fromiter(map(index.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids))
        if prev is None or (src < 0).any():
            missing = [r for r in req_ids if r not in index]
            raise RuntimeError(
                f"step computes tokens that were never sampled (requests {missing}): "
                "a placeholder without a sampled id"
            )
        dst = (cu_num_tokens[rows] - 1).astype(np.int64)
        if is_arange(src) and is_arange(dst):
            # The same requests in the same order, one token each.
            input_ids[: len(src)].copy_(prev[: len(src)])
            return input_ids
        to_device = self.staging.to_device
        dst_t, src_t = to_device("scatter_dst", dst), to_device("scatter_src", src)
        input_ids.index_copy_(0, dst_t, prev.index_select(0, src_t))
        return input_ids


def _use_fused_kernels(model: LlamaForCausalLM, fused: bool) -> None:
    """Switch the model's layers to (or off) the fused Triton kernels:
    residual add + RMSNorm, silu * up, and rotary inside the KV store."""
    rotary = model.model.rotary
    rotary.use_triton = fused
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.use_triton = fused
        elif isinstance(module, LlamaMLP):
            module.fused_silu_and_mul = fused
        elif isinstance(module, Attention):
            module.fused_rotary = rotary if fused else None
