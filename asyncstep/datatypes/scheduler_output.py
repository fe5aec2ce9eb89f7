"""What the scheduler sends the ranks each step (vLLM's
``vllm/v1/core/sched/output.py``): :class:`SchedulerOutput` with its new and
cached requests, then the step's :class:`GrammarOutput`. Imports
:mod:`.sampling_params` only.
"""

from __future__ import annotations

import msgspec

from asyncstep.datatypes.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, frozen=True):
    """A request the runner has not seen (or sees again after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, frozen=True):
    """Per-step deltas of requests the runner already holds (parallel lists)."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    #: True: the request was preempted; ``new_block_ids`` replaces its blocks.
    resumed_from_preemption: list[bool] = msgspec.field(default_factory=list)
    #: Tokens this rank did not sample itself (pipeline stages that do not sample).
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, frozen=True):
    """What one step computes: which requests, how many tokens each."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    #: req_id -> tokens scheduled this step (prompt chunk, or 1 when decoding).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    #: Requests that ended since the last step: the runner drops their state.
    finished_req_ids: list[str] = msgspec.field(default_factory=list)
    #: A request of the step follows a grammar: the last stage samples only
    #: once the step's :class:`GrammarOutput` has come.
    has_structured_output_requests: bool = False
    #: Speculative decoding: req_id -> the draft tokens the step verifies
    #: (vLLM's name). Such a request's ``num_scheduled_tokens`` is
    #: ``1 + len(drafts)``: its last known token, then the drafts; it samples
    #: ``1 + accepted`` tokens (see :class:`ModelRunnerOutput`).
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


class GrammarOutput(msgspec.Struct, frozen=True):
    """The token bitmask of one step's constrained requests (vLLM's
    ``GrammarOutput``), sent after the step's :class:`SchedulerOutput` once
    the engine has the tokens before it: row ``i`` (``ceil(vocab / 32)``
    little-endian int32 words; bit ``t`` set allows token ``t``) is that of
    ``structured_output_request_ids[i]``. A request with ``d`` draft tokens
    in the step (``scheduled_spec_decode_tokens``) has ``d + 1`` rows in a
    row, its id repeated: the masks of its draft positions, then of its
    bonus position."""

    step_id: int
    structured_output_request_ids: list[str]
    grammar_bitmask: bytes


#: What the engine sends a rank: each step, and each constrained step's bitmask after it.
RankInput = SchedulerOutput | GrammarOutput
