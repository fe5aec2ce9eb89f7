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
(by then the copy has long landed), and appends them to the persistent
batch. Inputs go to the device through pinned staging buffers guarded by
``prepare_inputs_event`` (:mod:`asyncstep.runner.staging`).

The runner holds the step's order; its parts live in their own modules:
the persistent batches and request states updated from each scheduler
output (:mod:`~asyncstep.runner.persistent_batches`), the sampled ids and
their appending to the batch (:mod:`~asyncstep.runner.sampled_tokens`), the
step's device inputs (:mod:`~asyncstep.runner.step_inputs`), the KV cache
tensors bound to the layers (:mod:`~asyncstep.runner.kv_cache_binding`), what a step
leaves (:mod:`~asyncstep.runner.step_state`) and its sampling
(:mod:`~asyncstep.runner.step_sampling`). A step spends little Python
per request (``fast_paths``; off, every part goes request by request, which
tests compare): the steady decode step (the same requests in the same rows
as the step before, one token each; :attr:`InputBatch.layout_version` tells
when rows moved) updates the batch with a few array operations, copies the
previous step's ids into the input ids without a gather, samples with the
last step's metadata and takes the decode path of the step inputs.

May import the runner's modules, the model (no layer class), ``asyncstep.device``,
``asyncstep.ops``, ``asyncstep.datatypes`` and ``asyncstep.config``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from asyncstep.config import CompilationConfig, SpeculativeConfig
from asyncstep.datatypes import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    GrammarOutput,
    IntermediateTensors,
    ModelRunnerOutput,
    SchedulerOutput,
)
from asyncstep.device.stream import record_event
from asyncstep.logging.spans import tracing
from asyncstep.models.dense_weights import dense_16_bit
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.ops.attention import BLOCK_DIM
from asyncstep.ops.select import resolve_attention_backend, select_ops
from asyncstep.ops.torch_attention import reference_attention_backends
from asyncstep.runner.async_output import AsyncModelRunnerOutput
from asyncstep.runner.cpu_threads import CpuThreads
from asyncstep.runner.cudagraph_dispatcher import (
    CudagraphDispatcher,
    CUDAGraphMode,
    resolve_cudagraph_mode,
)
from asyncstep.runner.cudagraph_runner import CudaGraphRunner
from asyncstep.runner.draft_model import DraftModel
from asyncstep.runner.input_batch import CachedRequestState, InputBatch
from asyncstep.runner.kv_cache_binding import KVCacheBinding, check_draft_windows
from asyncstep.runner.persistent_batches import PersistentBatches
from asyncstep.runner.prompt_logprobs import PromptLogprobsTracker
from asyncstep.runner.sampled_tokens import SampledTokens
from asyncstep.runner.staging import StagingBuffers
from asyncstep.runner.step_inputs import StepInputBuilder, StepInputs
from asyncstep.runner.step_sampling import StepSampling
from asyncstep.runner.step_state import ExecuteModelState, StepEvents, StepTimings
from asyncstep.runner.ubatch_forward import forward_ubatches

REENTRY_ERROR = "sample_tokens() must be called after execute_model() returns None"


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
        cpu_threads: CpuThreads | None = None,
        draft_model: LlamaForCausalLM | None = None,
        speculative_config: SpeculativeConfig | None = None,
        batch_invariant: bool | None = None,
    ) -> None:
        """``graph_stand_in``: run CUDA-graph modes without CUDA (graphs
        replayed by calling the captured function again), to test the
        graph wiring on the CPU; otherwise the CPU runs eagerly.

        ``num_input_batches``: persistent batches kept (pipeline parallelism:
        one per step in flight, whose requests differ, so alternating steps
        do not rebuild every row each step).

        ``speculative_config``: speculative decoding (None: off): verify
        steps of ``1 + num_speculative_tokens`` tokens a request get uniform
        decode graphs of their own. ``draft_model``: its draft model (method
        ``draft_model``), run beside ``model`` on the same device (see
        :mod:`asyncstep.runner.draft_model`). ``batch_invariant``: the op
        sets' choice (:func:`~asyncstep.ops.select.select_ops`; None: the
        device's default, on CUDA for a model of dense 16-bit weights
        without experts); the draft model follows the target's choice."""
        self.model = model
        self.device, self.dtype = device, dtype
        #: On the CPU: the steps' torch threads, fewer while other processes
        #: keep the cores busy (None: left as they are).
        self.cpu_threads = cpu_threads
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.is_last_stage = model.lm_head is not None
        #: The model's KV cache groups (:mod:`asyncstep.kv_cache_interface`)
        #: and which KV cache tensor each layer uses (its group's position).
        self.kv_binding = KVCacheBinding(model)
        num_kv_cache_groups = self.kv_binding.num_groups
        if draft_model is not None:
            check_draft_windows(model, draft_model, num_kv_cache_groups)
        #: The requests' states and the persistent batches holding their rows.
        self.batches = PersistentBatches(
            num_input_batches,
            max_num_reqs=max_num_reqs,
            max_model_len=max_model_len,
            block_size=block_size,
            device=device,
            is_last_stage=self.is_last_stage,
            num_kv_cache_groups=num_kv_cache_groups,
        )
        self.prompt_logprobs = PromptLogprobsTracker(
            model.config.vocab_size, enabled=self.is_last_stage
        )
        self.kv_caches: list[torch.Tensor] = []
        self.execute_model_state: ExecuteModelState | None = None
        self.timings = StepTimings()
        #: Sequence parallelism splits a step's tokens over the TP group: the
        #: step is padded to a multiple of tp_size (1 otherwise: no padding).
        self.num_tokens_multiple = model.num_tokens_multiple
        self.async_scheduling = async_scheduling
        self.staging = StagingBuffers(device)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        #: The sampled ids on the device, and the outputs not appended yet.
        self.sampled = SampledTokens(self.batches, self.staging)
        #: Record device events for step timelines even when not tracing (benchmarks).
        self.record_step_events = False
        #: The events of the last step that ran a forward.
        self.last_step_events: StepEvents | None = None
        compilation = compilation or CompilationConfig()
        self.attention_backend = resolve_attention_backend(
            compilation.attention_backend, device, dtype
        )
        self.fused_kernels = compilation.fused_kernels and self.attention_backend == "triton"
        #: The model's kernels: norms, activations, rotary, attention, matmuls.
        self.ops = select_ops(
            device,
            self.attention_backend,
            fused_kernels=compilation.fused_kernels,
            fused_decode=compilation.fused_decode,
            int8_activations=compilation.gpu_q4_activations == "int8",
            batch_invariant=batch_invariant,
            dense_16_bit=dense_16_bit(model, dtype),
        )
        model.use_ops(self.ops)
        #: ``draft_model`` speculation's draft model (None: not that method).
        self.drafter: DraftModel | None = None
        if draft_model is not None:
            assert speculative_config is not None
            # The draft model's own op set: no fused decode.
            draft_model.use_ops(
                select_ops(
                    device,
                    self.attention_backend,
                    fused_kernels=compilation.fused_kernels,
                    int8_activations=compilation.gpu_q4_activations == "int8",
                    batch_invariant=batch_invariant,
                    dense_16_bit=dense_16_bit(model, dtype),  # the target's choice
                )
            )
            self.drafter = DraftModel(
                draft_model,
                device=device,
                num_speculative_tokens=speculative_config.num_speculative_tokens,
                block_size=block_size,
                max_model_len=max_model_len,
                attention_backend=self.attention_backend,
                disable_by_batch_size=speculative_config.disable_by_batch_size,
            )
        #: The sampling half of each step (:mod:`asyncstep.runner.step_sampling`).
        self.sampling = StepSampling(
            self.batches,
            self.sampled,
            device=device,
            copy_stream=self._copy_stream,
            drafter=self.drafter,
            attention_backend=self.attention_backend,
            async_scheduling=async_scheduling,
        )
        mode = resolve_cudagraph_mode(
            compilation.cudagraph_mode, device, self.attention_backend, graph_stand_in
        )
        if self.drafter is not None and mode.has_full_cudagraphs():
            # The draft model runs eagerly on the step's attention metadata,
            # which a FULL graph's step does not build.
            none = mode.mixed_mode() is CUDAGraphMode.NONE
            mode = CUDAGraphMode.NONE if none else CUDAGraphMode.PIECEWISE
        self.dispatcher = CudagraphDispatcher(
            mode,
            max_num_seqs=max_num_reqs,
            max_num_batched_tokens=max_num_batched_tokens,
            capture_sizes=compilation.cudagraph_capture_sizes,
            max_capture_size=compilation.max_cudagraph_capture_size,
            num_tokens_multiple=self.num_tokens_multiple,
            uniform_decode_query_len=1
            + (speculative_config.num_speculative_tokens if speculative_config else 0),
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
    def requests(self) -> dict[str, CachedRequestState]:
        return self.batches.requests

    @property
    def input_batches(self) -> list[InputBatch]:
        return self.batches.input_batches

    @property
    def input_batch(self) -> InputBatch:
        """The persistent batch of the current step."""
        return self.batches.input_batch

    @property
    def fast_paths(self) -> bool:
        """Whether steps take the fast paths where they can (the steady
        decode step's; see the module doc). Off: every step the general
        path, which computes the same inputs (tests compare the two)."""
        return self.step_inputs.fast_paths

    @fast_paths.setter
    def fast_paths(self, enabled: bool) -> None:
        self.step_inputs.fast_paths = enabled
        self.batches.fast_paths = self.sampled.fast_paths = enabled
        for batch in self.input_batches:
            batch.cache_sampling_metadata = enabled

    # -- KV cache ---------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_caches[0].shape[BLOCK_DIM] if self.kv_caches else 0

    def kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes over this rank's KV cache tensors (all
        its layers; with several KV cache groups, one group's layers: a block
        belongs to one group)."""
        target = self.kv_binding.block_bytes(self.model, self.block_size, self.dtype)
        draft = self.drafter.kv_cache_block_bytes(self.dtype) if self.drafter else 0
        return target + draft

    def capture_model(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Capture the CUDA graphs the dispatcher lists (after the KV cache
        is bound: graphs hold its address), largest first; returns how many."""
        if self.dispatcher.mode is CUDAGraphMode.NONE or not self.dispatcher.capture_sizes:
            return 0
        assert self.kv_caches, "initialize the KV cache before capturing graphs"
        table = self.input_batch.block_table
        self.graph_runner = CudaGraphRunner(
            self.model,
            self.dispatcher,
            device=self.device,
            dtype=self.dtype,
            max_num_reqs=self.input_batch.max_num_reqs,
            max_blocks_per_req=table.max_num_blocks_per_req // table.num_groups,
            num_kv_groups=table.num_groups,
            stand_in=self._graph_stand_in,
            greedy_in_graph=self.step_inputs.compilation.greedy_in_graph,
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
        models = [self.model] + ([self.drafter.model] if self.drafter else [])
        for attn in (a for m in models for a in m.attention_layers()):
            attn.kv_cache = torch.empty(0)
        self.kv_caches = []
        if self.drafter is not None:
            self.drafter.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's paged cache and bind it to its attention
        layer (the draft model's too: the same blocks, a cache of its own)."""
        self.kv_caches = self._bind_kv_caches(self.model, num_blocks)
        if self.drafter is not None:
            self.drafter.kv_caches = self._bind_kv_caches(self.drafter.model, num_blocks)

    def _bind_kv_caches(self, model: LlamaForCausalLM, num_blocks: int) -> list[torch.Tensor]:
        """``model``'s KV cache tensors, bound (:class:`KVCacheBinding`)."""
        return self.kv_binding.bind(
            model, num_blocks, block_size=self.block_size, dtype=self.dtype, device=self.device
        )

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
        # A step with drafts needs its rows' every token on the host (the
        # drafts go after them): the newest sampled output too.
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        self.sampled.resolve(keep_last=self.async_scheduling and not spec_tokens)
        self.step_inputs.input_batch = self.batches.select(scheduler_output)
        self.batches.update(scheduler_output)
        if spec_tokens:
            self._write_drafts(spec_tokens)
        self.prompt_logprobs.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.timings = StepTimings()
            return EMPTY_MODEL_RUNNER_OUTPUT
        inputs = self.step_inputs.prepare(
            scheduler_output, intermediate_tensors, self.sampled.scatter
        )
        t1 = time.perf_counter()
        record = self.record_step_events or tracing()
        start = record_event(self.device) if record else None
        t2 = time.perf_counter()
        if self.cpu_threads is not None:
            self.cpu_threads.apply()
        if self.attention_backend == "torch":
            with reference_attention_backends():
                out = self._forward(inputs, intermediate_tensors)
                if self.drafter is not None:
                    self.drafter.mirror(inputs)
        else:
            out = self._forward(inputs, intermediate_tensors)
            if self.drafter is not None:
                self.drafter.mirror(inputs)
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
        if inputs.spec_decode_metadata is not None:
            self.execute_model_state.spec_decode_metadata = inputs.spec_decode_metadata
            self.execute_model_state.logits_indices = inputs.spec_decode_metadata.last_token_indices
        else:
            self.execute_model_state.greedy_ids = self._graph_greedy_ids(inputs)
        return None

    def _write_drafts(self, spec_tokens: dict[str, list[int]]) -> None:
        """Put each request's draft tokens after its known tokens in its row
        (the step's input ids read them there; ``num_tokens`` stays: the
        accepted ones are appended over them once sampled)."""
        batch = self.input_batch
        for req_id, drafts in spec_tokens.items():
            row = batch.req_id_to_index[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids_cpu[row, start : start + len(drafts)] = drafts

    def _graph_greedy_ids(self, inputs: StepInputs) -> torch.Tensor | None:
        """The argmax of each sampling row's logits, when the step's graph
        computed it (:mod:`~asyncstep.runner.greedy_graph`)."""
        if self.graph_runner is None:
            return None
        ids = self.graph_runner.greedy_ids(inputs.cudagraph_mode, inputs.batch_descriptor)
        return None if ids is None else ids[inputs.logits_indices]

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
        return self.sampling.sample_tokens(state, grammar_output, self.timings)
