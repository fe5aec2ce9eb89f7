"""The front end's view of one request in flight: what it has produced so
far, its detokenizer, and how its caller is woken.

Tokens are appended as each step's news arrives (the engine's output
processing, on the engine's output thread or its loop). A caller is woken only
when what it waits for is there: a ``generate`` caller once, when every
choice has ended (or one failed); a stream's reader once per batch of news
at most, however many steps it fell behind. A streamed request, and one with
stop strings (its end depends on its text), decodes each step's tokens as
they arrive; a ``generate`` request decodes once, as it finishes: the
caller takes text that is already there.

A request of ``n`` choices is a :class:`RequestGroup` of ``n`` states, one
per choice, each a request of its own in the core: the caller waits on the
group.

Threads: the output processing and the caller may run on two threads. What
they share (the states, a group's waiter) is touched only under the group's
``lock`` (the engine's, one for all its requests); a wake-up is not
delivered there but appended to the group's ``wakeups`` (the engine hands
them to the caller's loop, once per batch of news).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import anyio

from asyncstep.datatypes import FinishReason, Logprobs, SamplingParams
from asyncstep.engine.front_end.detokenizer import IncrementalDetokenizer
from asyncstep.engine.messages.outputs import Completion, CompletionChunk, CompletionOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        index: int = 0,
        group: RequestGroup | None = None,
        streamed: bool = False,
    ) -> None:
        #: The core's id of this choice (the caller's id when ``n`` is 1).
        self.request_id = request_id
        #: The choice (``0 .. n - 1``).
        self.index = index
        self.group = group
        #: Sent to the core (a choice after the first waits for the first's
        #: prompt to be cached: see ``Engine``).
        self.sent = True
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        #: Position 0 has none (vLLM's); the core sends the others chunk by chunk.
        self.prompt_logprobs: list[Logprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        #: Why the request cannot finish (refused, or the engine died or closed).
        self.error: BaseException | None = None
        #: Decode every step's tokens on arrival (stop strings need the text;
        #: a stream's reader takes text every step).
        self._eager = bool(params.stop) or streamed
        self._num_decoded = 0
        #: Tokens (and log-probs) already handed out in chunks.
        self._num_taken = 0
        self._ended_taken = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def ended(self) -> bool:
        """Finished, aborted or failed: nothing more will arrive."""
        return self.finish_reason is not None or self.error is not None

    # -- the engine's side ------------------------------------------------

    def add_output(
        self,
        new_token_ids: list[int],
        new_logprobs: list[Logprobs] | None,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
        new_prompt_logprobs: list[Logprobs] | None = None,
    ) -> str | None:
        """Record a step's news; returns a stop string the text reached, if any
        (the request then finishes with reason ``stop``)."""
        if self.prompt_logprobs is not None and new_prompt_logprobs:
            self.prompt_logprobs.extend(new_prompt_logprobs)
        self.token_ids.extend(new_token_ids)
        if self.logprobs is not None and new_logprobs:
            self.logprobs.extend(new_logprobs)
        stop_string = self._decode() if self._eager or finish_reason is not None else None
        if stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
            kept = self.detokenizer.num_tokens_at_stop
            if kept is not None and kept < len(self.token_ids):  # tokens after the stop
                del self.token_ids[kept:]
                self._num_decoded = kept
                if self.logprobs is not None:
                    del self.logprobs[kept:]
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        self._wake()
        return stop_string

    def fail(self, error: BaseException) -> None:
        """End the request with an error (refused, or the engine stopped)."""
        self.error = error
        self._wake()

    def abort(self) -> None:
        self.finish_reason = FinishReason.ABORT
        self._wake()

    def _wake(self) -> None:
        if self.group is not None:
            self.group.wake()

    def _decode(self) -> str | None:
        new = self.token_ids[self._num_decoded :]
        self._num_decoded = len(self.token_ids)
        return self.detokenizer.update(new) if new else None

    # -- the caller's side ------------------------------------------------

    def _take_chunk(self) -> CompletionChunk:
        self._decode()  # (decoded already, unless the request was aborted)
        start, end = self._num_taken, len(self.token_ids)
        self._num_taken = end
        first = not self._ended_taken and start == 0
        self._ended_taken = self.finished
        logprobs = self.logprobs[start:end] if self.logprobs is not None else None
        return CompletionChunk(
            request_id=self.group.request_id if self.group is not None else self.request_id,
            index=self.index,
            text=self.detokenizer.next_delta(self.finished),
            token_ids=self.token_ids[start:end],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs or None,
            prompt_logprobs=self.prompt_logprobs if first else None,
        )

    def output(self) -> CompletionOutput:
        """This choice, finished."""
        assert self.finish_reason is not None
        self._decode()  # (decoded already, unless the request was aborted)
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
        )


class RequestGroup:
    """The ``n`` choices of one request (``n`` = 1: one state)."""

    def __init__(
        self,
        request_id: str,
        client: str = "",
        *,
        lock: threading.Lock | None = None,
        wakeups: list[anyio.Event] | None = None,
    ) -> None:
        #: The caller's id.
        self.request_id = request_id
        #: Who asked (``Engine.generate``'s ``client``).
        self.client = client
        self.states: list[RequestState] = []
        #: Guards the states and the waiter (see the module doc).
        self.lock = lock if lock is not None else threading.Lock()
        #: Where wake-ups go, under ``lock`` (the engine delivers them).
        self.wakeups: list[anyio.Event] = wakeups if wakeups is not None else []
        self._waiter: anyio.Event | None = None
        #: The waiter waits for the end (``generate``), not for news (a stream).
        self._wants_end = False
        #: The next choice a chunk is looked for in (round robin).
        self._next = 0

    def wake(self) -> None:
        """News of a choice (under ``lock``): its waiter goes to ``wakeups``
        if what it waits for is there."""
        waiter = self._waiter
        if waiter is None or (self._wants_end and not self.done):
            return
        self._waiter = None
        self.wakeups.append(waiter)

    @property
    def done(self) -> bool:
        """Every choice has ended, or one failed."""
        return self.failed or all(s.ended for s in self.states)

    @property
    def failed(self) -> bool:
        return any(s.error is not None for s in self.states)

    def _waiting(self, wants_end: bool) -> anyio.Event:
        """A new waiter (under ``lock``)."""
        self._waiter = waiter = anyio.Event()
        self._wants_end = wants_end
        return waiter

    async def wait_finished(self) -> None:
        """Wait until every choice has ended (or one failed): one wake-up."""
        while True:
            with self.lock:
                if self.done:
                    return
                waiter = self._waiting(wants_end=True)
            await waiter.wait()

    async def next_chunk(self) -> CompletionChunk | None:
        """Everything new of one choice since its last chunk (waiting for
        it); None once every choice's last chunk was handed out, or one failed."""
        while True:
            with self.lock:
                if self.failed:
                    return None
                chunk, live = self._find_chunk()
                if chunk is not None or not live:
                    return chunk
                waiter = self._waiting(wants_end=False)
            await waiter.wait()

    def _find_chunk(self) -> tuple[CompletionChunk | None, bool]:
        """A choice's chunk, if one has news (round robin); and whether any
        choice has a chunk still to hand out (under ``lock``)."""
        states = self.states
        live = False
        for k in range(len(states)):
            state = states[(self._next + k) % len(states)]
            if state._ended_taken:
                continue
            live = True
            if len(state.token_ids) > state._num_taken or state.finished:
                self._next = (state.index + 1) % len(states)
                return state._take_chunk(), True
        return None, live

    def completion(self) -> Completion:
        first = self.states[0]
        return Completion.of(
            self.request_id,
            first.prompt,
            first.prompt_token_ids,
            [state.output() for state in self.states],
            first.prompt_logprobs,
        )
