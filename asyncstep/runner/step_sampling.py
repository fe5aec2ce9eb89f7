"""The sampling half of a step (vLLM v1's ``sample_tokens``): the logits
:meth:`ModelRunner.execute_model <asyncstep.runner.model_runner.ModelRunner.execute_model>`
kept, masked by the grammars' bitmasks, sampled (with speculative decoding:
the drafts verified by the rejection sampler, seeded requests replayed as
plain decoding draws them, the log-probs of every position), the ids copied
to the host on the copy stream, and the draft model's next drafts proposed.

:class:`StepSampling` is the runner's part for it: it reads the current
persistent batch and appends the sampled ids through
:class:`~asyncstep.runner.sampled_tokens.SampledTokens`; the runner keeps the
two-phase contract (one ``sample_tokens`` per ``execute_model`` that kept
logits). May import torch, numpy, ``asyncstep.datatypes``,
``asyncstep.device``, ``asyncstep.ops`` and the runner's modules below it
(never :mod:`asyncstep.runner.model_runner`).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from asyncstep.datatypes import GrammarOutput, ModelRunnerOutput
from asyncstep.device.stream import record_event
from asyncstep.ops.torch_attention import reference_attention_backends
from asyncstep.runner.async_output import AsyncModelRunnerOutput, host_logprobs
from asyncstep.runner.draft_model import DraftModel
from asyncstep.runner.grammar_bitmask import GrammarBitmask
from asyncstep.runner.greedy_graph import takes_graph_ids
from asyncstep.runner.host_copy import copy_to_host, copy_to_host_in_order
from asyncstep.runner.input_batch import InputBatch
from asyncstep.runner.logits_processing import LogitsProcessing, TokenHistory
from asyncstep.runner.persistent_batches import PersistentBatches
from asyncstep.runner.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler, target_probs
from asyncstep.runner.sampled_tokens import SampledTokens
from asyncstep.runner.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    compute_logprobs,
    gather_logprobs,
)
from asyncstep.runner.seeded_drafts import generator_states, seeded_tokens
from asyncstep.runner.spec_decode_metadata import to_device
from asyncstep.runner.step_state import ExecuteModelState, StepTimings


class StepSampling:
    """Samples a step's kept logits (:meth:`sample_tokens`) for the runner
    whose persistent batches, sampled ids, device and draft model it is
    given; it owns the sampler, the rejection sampler and the grammar
    bitmask (built by the first grammar)."""

    def __init__(
        self,
        batches: PersistentBatches,
        sampled: SampledTokens,
        *,
        device: torch.device,
        copy_stream: torch.cuda.Stream | None,
        drafter: DraftModel | None,
        attention_backend: str,
        async_scheduling: bool,
    ) -> None:
        self.batches = batches
        self.sampled = sampled
        self.device = device
        self._copy_stream = copy_stream
        self.drafter = drafter
        self.attention_backend = attention_backend
        self.async_scheduling = async_scheduling
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self._grammar_bitmask: GrammarBitmask | None = None  # built by the first grammar
        #: Steps whose tokens came from their FULL graph's argmax.
        self.num_graph_greedy_steps = 0

    @property
    def input_batch(self) -> InputBatch:
        """The persistent batch of the current step."""
        return self.batches.input_batch

    def sample_tokens(
        self,
        state: ExecuteModelState,
        grammar_output: GrammarOutput | None,
        timings: StepTimings,
    ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Sample ``state``'s logits, those of ``grammar_output``'s requests
        masked by their bitmask first; the grammar's and the sampling's
        times go to ``timings``. Synchronous runner: the output, the tokens
        appended to the batch. Async scheduling: an
        :class:`AsyncModelRunnerOutput` at once (the device still samples)."""
        t0 = time.perf_counter()
        spec = state.spec_decode_metadata
        if grammar_output is not None:
            state.greedy_ids = None  # (the argmax of the unmasked logits)
            if self._grammar_bitmask is None:
                self._grammar_bitmask = GrammarBitmask(self.device)
            if spec is not None:  # a row per draft position and the bonus position
                pairs = _spec_grammar_rows(state, grammar_output)
                self._grammar_bitmask.apply_rows(state.logits, grammar_output, pairs)
            else:
                rows = state.sample_rows
                req_ids = map(state.req_ids.__getitem__, rows)
                row_of = dict(zip(req_ids, range(len(rows)), strict=True))
                self._grammar_bitmask.apply(state.logits, grammar_output, row_of)
            timings.grammar = time.perf_counter() - t0
        if spec is not None:  # the sampler sees the bonus positions; the drafts' rows aside
            state.spec_logits = state.logits
            state.target_logits = state.logits[spec.target_logits_indices]
            state.logits = state.logits[spec.bonus_logits_indices]
        output = self._sample(state)
        output.prompt_logprobs = state.prompt_logprobs
        if self.drafter is not None and state.sample_rows:
            output.draft_token_ids = self._propose_drafts(state, output)
        if state.events is not None:
            state.events.copy_end = output.copy_event
        timings.sample = time.perf_counter() - t0
        if self.async_scheduling:
            self.sampled.keep(output)
            return output
        self.sampled.apply(output)
        return output.get_output()

    def _propose_drafts(
        self, state: ExecuteModelState, output: AsyncModelRunnerOutput
    ) -> dict[str, list[int]]:
        """The draft model's drafts after this step's output (waits for its tokens)."""
        assert self.drafter is not None
        tokens = output.sampled_token_lists()
        if self.attention_backend == "torch":
            with reference_attention_backends():
                return self.drafter.propose(self.input_batch, state, tokens)
        return self.drafter.propose(self.input_batch, state, tokens)

    def _sample(self, state: ExecuteModelState) -> AsyncModelRunnerOutput:
        """Enqueue sampling and the copy of its result to the host."""
        rows = state.sample_rows
        if not rows:
            self.sampled.clear()
            empty = torch.empty(0, dtype=torch.int64)
            return AsyncModelRunnerOutput(state.req_ids, [], empty, record_event(None))
        batch = self.input_batch
        metadata = batch.sampling_metadata(rows)
        history = None
        if metadata.processing is not None:
            history = self._token_history(state, metadata.processing)
        spec = state.spec_decode_metadata
        seeded = {}
        if spec is not None and metadata.processing is None:
            seeded = generator_states(metadata.generators, spec.num_draft_tokens)
        graph_ids = self._graph_greedy_ids(state, metadata)
        if graph_ids is not None:
            result = SamplerOutput(sampled_token_ids=graph_ids, logprobs_tensors=None)
        else:
            result = self.sampler(state.logits, metadata, history)
        sampled = result.sampled_token_ids
        if spec is not None:
            sampled = self._verify_drafts(state, sampled)
            if seeded:
                self._replay_seeded(state, sampled, seeded)
            self.sampled.clear()  # (no step scatters these ids: see SampledTokens.resolve)
        else:
            self.sampled.record(sampled, batch, rows, state.req_ids)
        tensors = [sampled]
        lp = result.logprobs_tensors
        positions = None
        if lp is not None and state.spec_decode_metadata is not None:
            lp, positions = self._spec_logprobs(state, sampled, metadata.max_num_logprobs)
        if lp is not None:
            tensors += [lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks]
        if graph_ids is not None:  # (the next replay rewrites them: copied in order)
            hosts, copy_event = copy_to_host_in_order(tensors, self.device)
        else:
            hosts, copy_event = copy_to_host(tensors, self._copy_stream)
        logprobs = None
        if lp is not None:
            asked = [self.input_batch.sampling_params[row].logprobs for row in rows]  # type: ignore[union-attr]
            logprobs = host_logprobs(hosts[1:], asked, positions)
        return AsyncModelRunnerOutput(state.req_ids, rows, hosts[0], copy_event, logprobs)

    def _graph_greedy_ids(
        self, state: ExecuteModelState, metadata: SamplingMetadata
    ) -> torch.Tensor | None:
        """The step's tokens as its FULL graph's argmax computed them, when
        the step samples that (:func:`takes_graph_ids`; no draft tokens, no
        grammar: ``sample_tokens`` dropped the ids then); else None."""
        if state.greedy_ids is None or state.spec_decode_metadata is not None:
            return None
        if not takes_graph_ids(metadata):
            return None
        self.num_graph_greedy_steps += 1
        if self.device.type != "cuda":  # the host "copy" is the tensor: not the buffer
            return state.greedy_ids.clone()
        return state.greedy_ids

    def _spec_logprobs(
        self, state: ExecuteModelState, output: torch.Tensor, num_logprobs: int | None
    ) -> tuple[LogprobsTensors, list[int]]:
        """A speculative step's log-probs: of the token each position of each
        sampling row output (``output``, ``[rows, 1 + max drafts]``, -1
        where none), from that position's logits (the raw ones, as the
        sampler's); and each row's number of positions."""
        spec = state.spec_decode_metadata
        assert spec is not None and state.spec_logits is not None and num_logprobs is not None
        counts = np.asarray(spec.num_draft_tokens, dtype=np.int64) + 1
        rows = np.repeat(np.arange(len(counts)), counts)
        columns = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        index = to_device(np.concatenate([rows, columns]), self.device).view(2, -1)
        tokens = output[index[0], index[1]].clamp_min(0)
        raw = compute_logprobs(state.spec_logits)
        return gather_logprobs(raw, num_logprobs, tokens), counts.tolist()

    def _verify_drafts(self, state: ExecuteModelState, bonus: torch.Tensor) -> torch.Tensor:
        """The step's output tokens per sampling row, ``[rows, 1 + max
        drafts]`` padded with -1: the rejection sampler over the drafts'
        logits, ``bonus`` (the sampler's token at each row's bonus position)
        after a row's drafts all pass."""
        spec = state.spec_decode_metadata
        assert spec is not None and state.target_logits is not None
        counts = zip(state.sample_rows, spec.num_draft_tokens, strict=True)
        draft_rows = [row for row, n in counts for _ in range(n)]
        metadata = self.input_batch.sampling_metadata_of_positions(draft_rows)
        return self.rejection_sampler(
            spec.draft_token_ids, spec.num_draft_tokens, state.target_logits, bonus, metadata
        )

    def _replay_seeded(
        self,
        state: ExecuteModelState,
        output: torch.Tensor,
        seeded: dict[int, tuple[torch.Generator, torch.Tensor]],
    ) -> None:
        """Rewrite the ``seeded`` rows of ``output`` (``[rows, 1 + max
        drafts]``) with plain decoding's draws (:mod:`~asyncstep.runner.seeded_drafts`),
        each generator first put back to its state before the step."""
        spec = state.spec_decode_metadata
        assert spec is not None and state.target_logits is not None
        counts = np.asarray(spec.num_draft_tokens, dtype=np.int64)
        starts = (np.cumsum(counts) - counts).tolist()
        drafts = spec.draft_token_ids.tolist()
        for i, (generator, before) in seeded.items():
            start, count = starts[i], int(counts[i])
            logits = torch.cat(
                [state.target_logits[start : start + count], state.logits[i : i + 1]]
            ).float()
            rows = [state.sample_rows[i]] * (count + 1)
            probs = target_probs(logits, self.input_batch.sampling_metadata_of_positions(rows))
            generator.set_state(before)
            tokens = seeded_tokens(probs, drafts[start : start + count], generator)
            output[i] = PLACEHOLDER_TOKEN_ID
            output[i, : len(tokens)] = torch.tensor(tokens, dtype=output.dtype)

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


def _spec_grammar_rows(
    state: ExecuteModelState, grammar_output: GrammarOutput
) -> list[tuple[int, int]]:
    """(logits row, bitmask row) of a speculative step's constrained
    requests: a request's ``j``-th bitmask row (its id repeated, one row per
    draft position and then the bonus position) masks its ``j``-th logits
    row."""
    spec = state.spec_decode_metadata
    assert spec is not None
    first_row: dict[str, tuple[int, int]] = {}  # req_id -> (first logits row, rows)
    start = 0
    for row, num_drafts in zip(state.sample_rows, spec.num_draft_tokens, strict=True):
        first_row[state.req_ids[row]] = (start, num_drafts + 1)
        start += num_drafts + 1
    pairs = []
    seen: dict[str, int] = {}
    for mask_row, req_id in enumerate(grammar_output.structured_output_request_ids):
        j = seen.get(req_id, 0)
        seen[req_id] = j + 1
        if req_id in first_row and j < first_row[req_id][1]:
            pairs.append((first_row[req_id][0] + j, mask_row))
    return pairs
