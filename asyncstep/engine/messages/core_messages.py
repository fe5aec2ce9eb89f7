"""The messages between the front end (``Engine``, in the caller's process)
and the engine core (scheduler and ranks, by default in a child process).

msgspec structs, msgpack on the wire (never pickle), one frame per message
(:class:`~asyncstep.channels.framing.MessageStream`, over a socket pair:
nothing listens, so no handshake). In-process the same objects travel through
memory channels, unencoded. One message per step each way: the front end
batches every request added, aborted or stopped since its last message into
one :class:`CoreInputs`; the core sends one :class:`CoreOutputs` per step
with every request's new tokens and finishes.

Order of a session: front end -> :class:`CoreSetup` (process mode only), core
-> :class:`LoadProgress`\\* then :class:`CoreReady` or :class:`CoreFailed`;
then :class:`CoreInputs` / :class:`WaitIdle` one way and
:class:`CoreOutputs` / :class:`Idle` the other, until :class:`Shutdown` (or
the end of the connection). Imports nothing heavy.
"""

from __future__ import annotations

import msgspec

from asyncstep.config import EngineConfig
from asyncstep.datatypes import FinishReason, Logprobs, SamplingParams, WeightReads


class EngineCoreRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request, validated and tokenized by the front end. ``client``: who
    asked (the caller's key, e.g. an HTTP client's address; with several
    front ends, prefixed with the front end's number), what the core's work
    is shared fairly between (grammar compiles)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    client: str = ""


class EngineCoreOutput(msgspec.Struct, frozen=True):
    """What one step produced for one request: new tokens and/or its end."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    #: The stop token id that ended it (None for EOS or a length cap).
    stop_reason: int | str | None = None
    #: One entry per new token, when the request asked for logprobs.
    new_logprobs: list[Logprobs] | None = None
    #: The prompt log-probs of the prompt positions the step computed (an
    #: output of a prompt chunk may hold these alone), when asked for.
    new_prompt_logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CoreStats(msgspec.Struct, frozen=True, array_like=True):
    """The scheduler's counters, sent with every output (``Engine.statistics``)."""

    num_steps: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    #: Speculative decoding (vLLM's names; see ``SpecDecodingStats``).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    #: A MoE model: the token rows routed to each expert since the engine
    #: started (the reporting stage's MoE layers, summed; [] for a dense model).
    moe_expert_tokens: list[int] = msgspec.field(default_factory=list)
    #: Prompt tokens looked up in the prefix cache, and those found (the
    #: hit rate's terms: data-parallel replicas' rates sum through them).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


# -- front end -> core ----------------------------------------------------------


class CoreSetup(msgspec.Struct, frozen=True, tag=True):
    """The whole configuration, sent as the child starts: it loads the model
    while the front end loads the tokenizer (``max_model_len`` and the
    device's defaults may still be unresolved: the core resolves them from
    the model, as the front end does)."""

    config: EngineConfig


class CoreStart(msgspec.Struct, frozen=True, tag=True):
    """The EOS ids (the tokenizer's among them), once the front end has its
    tokenizer: the core builds its scheduler with them."""

    eos_token_ids: list[int]


class CoreInputs(msgspec.Struct, frozen=True, tag=True):
    """Everything the front end has for the core since its last message."""

    new_requests: list[EngineCoreRequest] = msgspec.field(default_factory=list)
    #: Requests to drop (the caller aborted them).
    aborted: list[str] = msgspec.field(default_factory=list)
    #: Requests whose text reached a stop string (they finish as ``stop``).
    stopped: list[str] = msgspec.field(default_factory=list)


class WaitIdle(msgspec.Struct, frozen=True, tag=True):
    """Answer with :class:`Idle` once nothing is in flight or left to schedule."""

    ticket: int


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


# -- core -> front end ----------------------------------------------------------


class LoadProgress(msgspec.Struct, frozen=True, tag=True):
    done: int
    total: int


class CoreReady(msgspec.Struct, frozen=True, tag=True):
    stats: CoreStats
    #: Process ids of the ranks the core started (none for an in-process rank).
    rank_pids: list[int] = msgspec.field(default_factory=list)
    #: The weight bytes a forward step of the model reads, by its size.
    weight_reads: WeightReads | None = None


class RejectedRequest(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    error: str


class CoreOutputs(msgspec.Struct, frozen=True, tag=True):
    """One step's news for every request that got tokens or finished, and
    the requests the scheduler refused since the last message."""

    step_id: int
    outputs: list[EngineCoreOutput]
    stats: CoreStats
    rejected: list[RejectedRequest] = msgspec.field(default_factory=list)


class Idle(msgspec.Struct, frozen=True, tag=True):
    ticket: int
    stats: CoreStats


class CoreFailed(msgspec.Struct, frozen=True, tag=True):
    """The core stopped on an error. ``kind`` names an ``asyncstep.errors``
    class when the error is one (a bad model file, a bad configuration)."""

    error: str
    kind: str | None = None


ToCore = CoreSetup | CoreStart | CoreInputs | WaitIdle | Shutdown
FromCore = LoadProgress | CoreReady | CoreOutputs | Idle | CoreFailed
