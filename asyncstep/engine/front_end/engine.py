"""The front end: requests in, text out (vLLM v1's ``AsyncLLM``).

:class:`Engine` lives on the caller's event loop (Trio, or asyncio through
AnyIO). Its :class:`~asyncstep.engine.front_end.input_processor.InputProcessor`
checks each request whole and tokenizes it before anything of it is kept or
sent (a refused request raises :class:`InvalidRequestError` and leaves
nothing behind); the engine then hands it to the engine core
(:mod:`asyncstep.engine.core.engine_core`: the scheduler and the ranks, by
default in a process of its own), and turns the core's per-step token news
into text for the callers: detokenization, stop strings, the client streams
(:mod:`asyncstep.engine.front_end.output_processor`, on the engine's output
thread). It never waits on the core to accept a request: requests, aborts
and stops queue on an unbounded channel that the transport sends as one
message per batch (:mod:`asyncstep.engine.front_end.serving`).

An engine serves the event loop it was opened on: its methods called from
another loop or thread raise :class:`EngineLoopError` at once;
``statistics()`` and ``error`` read from any thread.
:class:`asyncstep.LLM` is the blocking API over an engine on a loop of its
own.

A caller of :meth:`Engine.generate` is woken once, when its request ends; a
reader of :meth:`Engine.stream` once per batch of the core's messages at
most (one step's, or every step that arrived while the loop was busy), with
everything new since its last chunk. A streamed request, and one with stop
strings, has its new tokens decoded as they arrive, a ``generate`` request
once, as it ends (on the output thread).
:func:`asyncstep.open_engine` starts it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
from anyio.abc import TaskStatus

from asyncstep.checks import shown
from asyncstep.config import EngineConfig
from asyncstep.datatypes import SamplingParams, WeightReads
from asyncstep.engine.chat.chat_replies import (
    ReplyStream,
    chat_chunk,
    chat_completion,
)
from asyncstep.engine.front_end.chat_request import check_chat
from asyncstep.engine.front_end.input_processor import InputProcessor, Prompt, check_request_id
from asyncstep.engine.front_end.output_processor import OutputProcessor
from asyncstep.engine.front_end.request_state import RequestGroup, RequestState
from asyncstep.engine.front_end.serving import EngineServing
from asyncstep.engine.front_end.statistics import EngineStatistics
from asyncstep.engine.messages.core_messages import CoreInputs, ToCore, WaitIdle
from asyncstep.engine.messages.outputs import ChatChunk, ChatCompletion, Completion, CompletionChunk
from asyncstep.engine.transport.core_client import CoreClient
from asyncstep.errors import EngineDeadError, InvalidRequestError, describe
from asyncstep.models.config import ModelArchConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Engine:
    """Serves generation requests (use :func:`asyncstep.open_engine`)."""

    def __init__(
        self,
        config: EngineConfig,
        arch_config: ModelArchConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        core: CoreClient,
        *,
        request_id_prefix: str = "req-",
    ) -> None:
        self.config = config
        self.arch_config = arch_config
        self.tokenizer = tokenizer
        #: The engine core's transport (an ``EngineCore`` itself in-process).
        self.core = core
        self.max_model_len = config.model.max_model_len or 0
        #: Checks and tokenizes each request at the door.
        self.input_processor = InputProcessor(
            arch_config, tokenizer, self.max_model_len, config.structured_outputs
        )
        #: What ends a request unless it ignores EOS (``min_tokens`` bans them early).
        self.eos_token_ids = self.input_processor.eos_token_ids
        #: The requests in flight, and the core's news into them.
        self.output_processor = OutputProcessor(self._send)
        #: The core started, its messages read, the loop served, the end.
        self.serving = EngineServing(core, self.output_processor)
        self._ids = itertools.count()
        #: Generated request ids start with it (front ends of one core differ).
        self._id_prefix = request_id_prefix
        self._tickets = itertools.count()

    # -- public API -------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        client: str = "",
    ) -> Completion:
        """Generate one completion (its ``n`` choices) and return it whole.
        ``client``: who asks (e.g. an HTTP client's address): the engine
        core shares its work fairly between clients (grammar compiles).

        Cancelling the caller aborts the request (its blocks are freed).
        """
        self._check_loop()
        await self.input_processor.check_grammar(sampling_params)
        ids = await self.input_processor.encode_prompt(prompt)
        group = self._add_request(prompt, ids, sampling_params, request_id, client, streamed=False)
        try:
            await group.wait_finished()
        finally:
            self._abort_group(group)
        for state in group.states:
            self._raise_if_failed(state)
        return group.completion()

    async def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        client: str = "",
    ) -> AsyncIterator[CompletionChunk]:
        """Generate one completion chunk by chunk: each chunk holds the text
        and tokens new since the previous one (one step's, or several when
        the reader fell behind) of one choice (its ``index``; with ``n`` > 1
        the choices' chunks interleave). ``client`` as for :meth:`generate`.
        Leaving the iteration early aborts the request.
        """
        self._check_loop()
        await self.input_processor.check_grammar(sampling_params)
        ids = await self.input_processor.encode_prompt(prompt)
        group = self._add_request(prompt, ids, sampling_params, request_id, client, streamed=True)
        try:
            while (chunk := await group.next_chunk()) is not None:
                yield chunk
        finally:
            self._abort_group(group)
        for state in group.states:
            self._raise_if_failed(state)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        client: str = "",
    ) -> ChatCompletion:
        """Answer a chat whole: its choices read apart into thinking
        (``reasoning_content``, with the engine's ``reasoning_parser``),
        answer (``content``) and calls (``tool_calls``: ids, names, JSON
        arguments; finish reason ``tool_calls``).

        ``tools`` and ``tool_choice`` are OpenAI's (JSON values):
        ``required`` or ``{"type": "function", "function": {"name": ...}}``
        force the calls through a grammar built from the tools' parameters
        (every call parses and validates; ``parallel_tool_calls=False``: at
        most one); ``auto`` (the default with tools) needs
        ``tool_call_parser`` (``hermes``, ``llama3_json``) to read the calls
        the model writes; ``none`` reads none. ``chat_template`` replaces the
        tokenizer's template for this request (code: the caller's own,
        rendered sandboxed) and ``chat_template_kwargs`` are its variables.
        Every field is checked before anything is sent (one-line
        :class:`InvalidRequestError`); ``request_id``, ``client`` and
        cancelling as for :meth:`generate`."""
        self._check_loop()
        ids, params, reader = await check_chat(
            self.input_processor,
            self.config,
            messages,
            sampling_params,
            tools,
            tool_choice,
            parallel_tool_calls,
            tool_call_parser,
            chat_template,
            chat_template_kwargs,
        )
        completion = await self.generate(ids, params, request_id=request_id, client=client)
        return chat_completion(completion, reader)

    async def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_call_parser: str | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        request_id: str | None = None,
        client: str = "",
    ) -> AsyncIterator[ChatChunk]:
        """:meth:`chat`, chunk by chunk as OpenAI streams it: each chunk one
        choice's new thinking, answer and call deltas (a named call's id and
        name first, then its arguments; each of ``required``'s and
        ``auto``'s calls whole once it is complete). A chunk with nothing
        new is left out: its tokens come with the next. The arguments as
        :meth:`chat`; leaving the iteration early aborts the request."""
        self._check_loop()
        ids, params, reader = await check_chat(
            self.input_processor,
            self.config,
            messages,
            sampling_params,
            tools,
            tool_choice,
            parallel_tool_calls,
            tool_call_parser,
            chat_template,
            chat_template_kwargs,
        )
        streams: dict[int, ReplyStream] = {}
        chunks = cast(
            AsyncGenerator[CompletionChunk, None],
            self.stream(ids, params, request_id=request_id, client=client),
        )
        async with contextlib.aclosing(chunks):  # leaving early aborts the request
            async for chunk in chunks:
                piece = streams.setdefault(chunk.index, reader.stream()).take(chunk)
                if piece is None:
                    continue  # nothing new: its tokens go with the next
                yield chat_chunk(chunk, piece)

    def abort(self, request_id: str) -> None:
        """Abort a request in flight, every choice of it (no-op when it
        already ended)."""
        self._check_loop()
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {shown(request_id)}")
        group = self.output_processor.groups.get(request_id)
        if group is not None:
            self._abort_group(group)

    async def wait_idle(self) -> None:
        """Wait until no step is in flight and nothing is left to schedule:
        aborted and finished requests have given back their blocks (they
        wait for the steps in flight that use them)."""
        self._check_loop()
        self._check_alive()
        ticket = next(self._tickets)
        event = self.output_processor.idle_waiter(ticket)
        self._send(WaitIdle(ticket))
        await event.wait()
        self._check_alive()

    async def encode_prompt(
        self,
        prompt: Prompt,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a prompt: text as ``tokenizer(text).input_ids``, chat
        messages through the chat template (the tokenizer's, or
        ``chat_template``; ``tools``: function schemas, its ``tools``;
        ``chat_template_kwargs``: its variables), token ids as they are. A
        prompt that cannot fit the context is refused by its size before it
        is tokenized; long text is tokenized in a worker thread. Anything
        else, or ids the model cannot take, raise :class:`InvalidRequestError`."""
        self._check_loop()
        return await self.input_processor.encode_prompt(
            prompt,
            tools=tools,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )

    def encode_prompt_nowait(self, prompt: Prompt) -> list[int]:
        """:meth:`encode_prompt` on the caller's thread (long text blocks
        the event loop while it is tokenized)."""
        return self.input_processor.encode_prompt_nowait(prompt)

    def statistics(self) -> EngineStatistics:
        """Counters; the scheduler's are as of the core's latest message."""
        return self.output_processor.statistics()

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the engine, if one did."""
        return self.serving.error

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the rank processes (none when the rank runs in the core)."""
        return self.serving.rank_pids

    @property
    def weight_reads(self) -> WeightReads | None:
        """The weight bytes a forward step reads, by its size (the floor of a
        memory-bound step; ``asyncstep bench``'s): the core's report."""
        return self.serving.weight_reads

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the engine core, then hand its outputs to the requests until
        it stops. A failure while starting is raised; a failure later ends
        every request in flight with :class:`EngineDeadError`."""
        await self.serving.serve(task_status=task_status)

    async def wait_stopped(self) -> None:
        """Wait until the engine has stopped: closed, or dead (then
        :attr:`error` says why)."""
        await self.serving.wait_stopped()

    async def aclose(self, timeout_s: float = 10.0) -> bool:
        """Stop after the steps in flight: requests still running fail with
        :class:`EngineDeadError`, the ranks are told to shut down. Returns
        False if that took longer than ``timeout_s`` (the caller then cancels)."""
        return await self.serving.aclose(timeout_s)

    # -- requests ---------------------------------------------------------

    def _add_request(
        self,
        prompt: Prompt,
        ids: list[int],
        params: SamplingParams | None,
        request_id: str | None,
        client: str = "",
        *,
        streamed: bool,
    ) -> RequestGroup:
        """Check the rest of the request (``ids``: its prompt's, checked),
        then register it and send it to the core: a request refused here
        leaves nothing behind (``n`` > 1: see
        :meth:`~asyncstep.engine.front_end.output_processor.OutputProcessor.add_request`)."""
        self._check_alive()
        params = self.input_processor.check_params(params, len(ids))
        request_id = self._check_request_id(request_id)
        if not isinstance(client, str):
            raise InvalidRequestError(f"client must be a string, got {shown(client)}")
        return self.output_processor.add_request(
            request_id,
            client,
            prompt if isinstance(prompt, str) else None,
            ids,
            params,
            self.tokenizer,
            streamed=streamed,
            prefix_caching=self.config.cache.enable_prefix_caching,
        )

    def _check_request_id(self, request_id: object) -> str:
        if request_id is None:
            return f"{self._id_prefix}{next(self._ids)}"
        request_id = check_request_id(request_id)
        if self.output_processor.in_flight(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        return request_id

    def _abort_group(self, group: RequestGroup) -> None:
        """Abort every choice still running; forget the group."""
        aborted = self.output_processor.abort(group)
        self.serving.deliver_wakeups()
        if aborted:
            self._send(CoreInputs(aborted=aborted))

    def _raise_if_failed(self, state: RequestState) -> None:
        if state.error is None:
            return
        if isinstance(state.error, InvalidRequestError):
            raise InvalidRequestError(str(state.error))
        raise EngineDeadError(
            f"request {state.request_id} failed: {describe(state.error)}"
        ) from state.error

    def _send(self, message: ToCore) -> None:
        self.serving.send(message)

    def _check_loop(self) -> None:
        self.serving.check_loop()

    def _check_alive(self) -> None:
        self.serving.check_alive()
