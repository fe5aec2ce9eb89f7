"""One generation request as the engine process tracks it.

Holds :class:`RequestStatus` and :class:`Request` (prompt, sampled tokens, how
many tokens the KV cache holds, status, prefix-cache block hashes). Pure
Python; may import only the standard library, msgspec and
``asyncstep.datatypes`` / ``asyncstep.config`` / ``asyncstep.errors``.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterable, Sequence

from asyncstep.datatypes import MAX_COUNT, FinishReason, SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    """Where a request is in its life (the ``FINISHED_*`` values end it)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= FIRST_FINISHED_STATUS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


#: The first ``FINISHED_*`` status: ``status >= FIRST_FINISHED_STATUS`` is ``is_finished``.
FIRST_FINISHED_STATUS = RequestStatus.FINISHED_STOPPED

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """A prompt, the tokens sampled for it so far, and its scheduling state.

    ``num_computed_tokens`` counts the leading tokens of :attr:`all_token_ids`
    whose KV the cache holds (or will hold once the step that scheduled them
    has run: the scheduler advances it in ``schedule()``); with async
    scheduling it may run ``num_output_placeholders`` past them (the steps in
    flight compute tokens whose ids come back later). ``block_hashes`` is
    the chain of hashes of the full blocks of :attr:`all_token_ids`, filled in
    lazily by the KV cache manager (it outlives a preemption).

    The stop rules the scheduler checks every step are kept as plain
    attributes, derived from :attr:`sampling_params` and :attr:`eos_token_ids`
    (and refreshed when either is assigned): :attr:`stop_ids`,
    :attr:`max_num_tokens` and :attr:`min_tokens` (a stop id ends the
    request only once that many tokens are out). :attr:`num_tokens` is kept
    up to date by :meth:`append_output_token_id` /
    :meth:`append_output_token_ids` (the only ways to add tokens).
    """

    __slots__ = (
        "_all_token_ids",
        "_eos_token_ids",
        "_sampling_params",
        "arrival_index",
        "arrival_time",
        "block_hashes",
        "max_num_tokens",
        "min_tokens",
        "num_computed_tokens",
        "num_in_flight_steps",
        "num_output_placeholders",
        "num_preemptions",
        "num_tokens",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
        "spec_backoff",
        "spec_misses",
        "speculates",
        "status",
        "stop_ids",
        "stop_reason",
    )

    #: Prompt plus output tokens (``len(all_token_ids)``), kept up to date.
    num_tokens: int
    #: ``num_tokens`` at which ``max_tokens`` is reached: prompt + ``max_tokens``
    #: (None: past any context).
    max_num_tokens: int
    #: Tokens that end the request: ``stop_token_ids``, plus the EOS ids unless
    #: ``ignore_eos``.
    stop_ids: frozenset[int]
    #: Outputs before which a stop id does not end the request (``min_tokens``).
    min_tokens: int
    #: Whether the request may be given draft tokens (speculative decoding):
    #: not when the sampler must see each token before the next (penalties,
    #: logit bias, ``min_tokens``, bad words) or the request asks for prompt
    #: log-probs. (A grammar's drafts are checked by its matcher.)
    speculates: bool
    #: Speculation's back-off (see :func:`asyncstep.engine.core.step_results.settle_drafts`).
    spec_misses: int
    spec_backoff: int

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_index: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self._sampling_params = sampling_params
        self._eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.arrival_index: int = next(_arrival_counter) if arrival_index is None else arrival_index
        self.arrival_time: float = time.monotonic()
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_tokens = len(self._all_token_ids)
        self.num_computed_tokens = 0
        #: Tokens sampled by steps in flight whose ids the engine does not
        #: know yet (async scheduling schedules the next step over them).
        self.num_output_placeholders = 0
        #: Steps sent to the ranks that include this request, output not back yet.
        self.num_in_flight_steps = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        #: Speculation: verify steps in a row that accepted no draft, and
        #: decode steps still to go without drafts because of them.
        self.spec_misses = 0
        self.spec_backoff = 0
        # Typed loosely on purpose: the KV cache manager owns the hash type.
        self.block_hashes: list[bytes] = []
        self._derive_stop_rules()

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    def _derive_stop_rules(self) -> None:
        params = self._sampling_params
        # None: up to the context (where the scheduler ends every request).
        budget = MAX_COUNT if params.max_tokens is None else params.max_tokens
        self.max_num_tokens = len(self.prompt_token_ids) + budget
        self.min_tokens = params.min_tokens
        stop_ids = frozenset(params.stop_token_ids)
        self.stop_ids = stop_ids if params.ignore_eos else stop_ids | self._eos_token_ids
        self.speculates = params.speculates

    @property
    def sampling_params(self) -> SamplingParams:
        return self._sampling_params

    @sampling_params.setter
    def sampling_params(self, params: SamplingParams) -> None:
        self._sampling_params = params
        self._derive_stop_rules()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, token_ids: Iterable[int]) -> None:
        self._eos_token_ids = frozenset(token_ids)
        self._derive_stop_rules()

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt followed by the output tokens (do not mutate)."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= FIRST_FINISHED_STATUS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        """Append one sampled token (the decode step's common case)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        self.num_tokens += 1

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = (token_ids,)
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)
        self.num_tokens = len(self._all_token_ids)
