"""The requests in flight, and the core's news into them (vLLM v1's
``OutputProcessor``).

:class:`OutputProcessor` keeps each request from the moment the front end
sends it until it ends, is aborted or fails: its choices' states
(:class:`~asyncstep.engine.front_end.request_state.RequestState`, one core
request each) and their group. It turns each batch of the core's messages
into those states, on the engine's output thread, and collects the waiters
to wake; what it shares with the callers (the requests in flight, their
states, the waiters) is touched under its :attr:`~OutputProcessor.lock`.
What it has to tell the core (a request, the choices held back for the
first one's prompt, the requests a stop string ended) it queues through the
``send`` it was given, which never waits.

Imports the core's messages, the request states and the statistics only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import msgspec

from asyncstep.channels.framing import ProtocolError
from asyncstep.datatypes import MAX_SEED, SamplingParams
from asyncstep.engine.front_end.request_state import RequestGroup, RequestState
from asyncstep.engine.front_end.statistics import EngineStatistics, engine_statistics
from asyncstep.engine.messages.core_messages import (
    CoreFailed,
    CoreInputs,
    CoreOutputs,
    CoreStats,
    EngineCoreRequest,
    FromCore,
    Idle,
    ToCore,
)
from asyncstep.errors import InvalidRequestError
from asyncstep.logging.spans import span

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputProcessor:
    """The requests in flight and their news (see the module doc)."""

    def __init__(self, send: Callable[[ToCore], None]) -> None:
        """``send``: queues a message for the core, from any thread."""
        #: Guards what the output processing shares with the callers: the
        #: requests in flight, their states, their waiters, the wake-ups.
        self.lock = threading.Lock()
        #: Core request id -> its state (one per choice).
        self.requests: dict[str, RequestState] = {}
        #: The caller's request id -> its choices (the caller's loop only).
        self.groups: dict[str, RequestGroup] = {}
        #: Waiters to wake (under the lock), delivered once per batch of news.
        self.wakeups: list[anyio.Event] = []
        #: ``Engine.wait_idle``'s waiters, by their ticket.
        self.idle_waiters: dict[int, anyio.Event] = {}
        #: The core's counters, as of its latest message.
        self.core_stats = CoreStats()
        self.num_generated_tokens = 0
        self.num_finished = 0
        self._send = send
        #: Decodes the core's frames (a transport forwards them undecoded).
        self._decoder = msgspec.msgpack.Decoder(FromCore)

    # -- the caller's side --------------------------------------------------

    def add_request(
        self,
        request_id: str,
        client: str,
        text: str | None,
        ids: list[int],
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        streamed: bool,
        prefix_caching: bool,
    ) -> RequestGroup:
        """Register a request (checked: its id is not in flight) and send it
        to the core.

        ``n`` > 1: one core request per choice, ids ``{request_id}-{i}``,
        choice ``i`` seeded with ``seed + i``. With ``prefix_caching`` the
        first choice goes alone, and the others once it has its first token
        (its prompt's blocks are then cached: the others reuse them, vLLM's
        parallel sampling)."""
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        group = RequestGroup(request_id, client, lock=self.lock, wakeups=self.wakeups)
        for i, child_id in enumerate(child_ids):
            child = params if n == 1 else _choice_params(params, i)
            group.states.append(
                RequestState(
                    child_id, text, ids, child, tokenizer,
                    index=i, group=group, streamed=streamed,
                )
            )  # fmt: skip
        first, *others = group.states
        held = bool(others) and prefix_caching
        with self.lock:
            taken = [c for c in child_ids[1:] if c in self.requests]
            if taken:
                raise InvalidRequestError(f"request id {taken[0]!r} is already in flight")
            for state in group.states:
                state.sent = not held or state is first
                self.requests[state.request_id] = state
        self.groups[request_id] = group
        sent = [first] if held else group.states
        self._send(CoreInputs(new_requests=[_core_request(s) for s in sent]))
        return group

    def in_flight(self, request_id: str) -> bool:
        """Whether a request, or a choice, of this id is in flight."""
        with self.lock:
            in_flight = request_id in self.requests
        return in_flight or request_id in self.groups

    def abort(self, group: RequestGroup) -> list[str]:
        """Abort every choice still running; forget the group. Returns the
        ids the core was sent (to abort there); the waiters are among
        :meth:`take_wakeups`."""
        self.groups.pop(group.request_id, None)
        aborted = []
        with self.lock:
            for state in group.states:
                if state.finished or state.error is not None:
                    continue
                self.requests.pop(state.request_id, None)
                state.abort()
                if state.sent:
                    aborted.append(state.request_id)
        return aborted

    def idle_waiter(self, ticket: int) -> anyio.Event:
        """The event set when the core reports idle for ``ticket``."""
        with self.lock:
            event = self.idle_waiters[ticket] = anyio.Event()
        return event

    def take_wakeups(self) -> list[anyio.Event]:
        """The waiters to wake, taken."""
        with self.lock:
            wakeups = self.wakeups[:]
            self.wakeups.clear()
        return wakeups

    def fail_all(self, error: BaseException) -> None:
        """The engine stopped: every request in flight fails with ``error``,
        every idle waiter is to wake."""
        with self.lock:
            for state in self.requests.values():
                state.fail(error)
            self.requests.clear()
            self.wakeups.extend(self.idle_waiters.values())
            self.idle_waiters.clear()

    def statistics(self) -> EngineStatistics:
        """Counters; the core's are as of its latest message."""
        with self.lock:
            core = self.core_stats
            num_generated_tokens, num_finished = self.num_generated_tokens, self.num_finished
        return engine_statistics(core, num_generated_tokens, num_finished)

    # -- the core's side (the output thread) ----------------------------------

    def take_messages(self, messages: list[FromCore | bytes]) -> CoreFailed | None:
        """Process a batch of the core's messages, up to a CoreFailed (then
        returned, the messages after it left)."""
        with self.lock:
            for item in messages:
                message = self.decode(item) if isinstance(item, bytes) else item
                if isinstance(message, CoreOutputs):
                    with span("output", "frontend", step=message.step_id):
                        self.process_outputs(message)
                elif isinstance(message, Idle):
                    self.core_stats = message.stats
                    event = self.idle_waiters.pop(message.ticket, None)
                    if event is not None:
                        self.wakeups.append(event)
                elif isinstance(message, CoreFailed):
                    return message
        return None

    def decode(self, frame: bytes) -> FromCore:
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad message from the engine core: {exc}") from None

    def process_outputs(self, message: CoreOutputs) -> None:
        """A step's news into the requests' states (under the lock)."""
        self.core_stats = message.stats
        requests = self.requests
        for rejected in message.rejected:
            state = requests.pop(rejected.request_id, None)
            if state is not None:
                state.fail(InvalidRequestError(rejected.error))
                for sibling in state.group.states if state.group is not None else ():
                    if not sibling.sent:  # the held choices would be refused alike
                        requests.pop(sibling.request_id, None)
                        sibling.sent = True
                        sibling.fail(InvalidRequestError(rejected.error))
        stopped: list[str] = []
        for news in message.outputs:
            state = requests.get(news.request_id)
            if state is None:
                continue  # aborted, or stopped by a stop string a step ago
            num_before = len(state.token_ids)
            stop_string = state.add_output(
                news.new_token_ids,
                news.new_logprobs,
                news.finish_reason,
                news.stop_reason,
                news.new_prompt_logprobs,
            )
            # (A stop string may have cut a step's tokens after it.)
            self.num_generated_tokens += len(state.token_ids) - num_before
            group = state.group
            if (
                group is not None
                and state.index == 0
                and not group.states[-1].sent
                and (state.token_ids or state.finished)  # not a prompt chunk's log-probs
            ):
                self._send_held(group)
            if stop_string is not None and not news.finished:
                stopped.append(news.request_id)
            if state.finished:
                self.num_finished += 1
                del requests[news.request_id]
        if stopped:
            self._send(CoreInputs(stopped=stopped))

    def _send_held(self, group: RequestGroup) -> None:
        """Send the choices that waited for the first one's prompt."""
        held = [s for s in group.states if not s.sent and not s.ended]
        for state in group.states:
            state.sent = True
        if held:
            self._send(CoreInputs(new_requests=[_core_request(s) for s in held]))


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of an ``n``-choice request: one choice, its own seed;
    the first alone computes the prompt log-probs (the others may then hit
    the prefix cache)."""
    seed = None if params.seed is None else (params.seed + index) % (MAX_SEED + 1)
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return msgspec.structs.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _core_request(state: RequestState) -> EngineCoreRequest:
    client = state.group.client if state.group is not None else ""
    return EngineCoreRequest(state.request_id, state.prompt_token_ids, state.params, client)
