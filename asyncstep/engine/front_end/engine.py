"""The front end: requests in, text out (vLLM v1's ``AsyncLLM`` and its
output processor).

:class:`Engine` lives on the caller's event loop (Trio, or asyncio through
AnyIO). Its :class:`~asyncstep.engine.front_end.input_processor.InputProcessor` checks
each request whole and tokenizes it before anything of it is kept or sent (a
refused request raises :class:`InvalidRequestError` and leaves nothing
behind); the engine then hands it to the engine core
(:mod:`asyncstep.engine.core.engine_core`: the scheduler and the ranks, by default in a
process of its own), and turns the core's per-step token news into text for
the callers: detokenization, stop strings, the client streams. It never
waits on the core to accept a request: requests, aborts and stops queue on
an unbounded channel that the transport sends as one message per batch.

The core's messages are processed off the caller's loop, on the engine's
output thread (:mod:`asyncstep.engine.front_end.output_thread`): the loop hands it
each batch of them as it arrives (undecoded, from a core in its own
process) and gets back one call per batch with the callers to wake. What
the thread shares with the callers (the requests in flight, their states,
the waiters) is touched under the engine's lock only.

An engine serves the event loop it was opened on: its methods called from
another loop or thread raise :class:`EngineLoopError` at once (they would
hang, or corrupt its state); ``statistics()`` and ``error`` read from any
thread. :class:`asyncstep.LLM` is the blocking API over an engine on a loop
of its own.

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
import math
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import anyio
import anyio.lowlevel
import msgspec
import sniffio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from asyncstep.channels.framing import ProtocolError
from asyncstep.checks import shown
from asyncstep.config import EngineConfig
from asyncstep.datatypes import MAX_SEED, SamplingParams, WeightReads
from asyncstep.engine.chat.chat_messages import is_chat
from asyncstep.engine.chat.chat_replies import ReplyReader, ReplyStream, finish_reason
from asyncstep.engine.chat.reasoning import ReasoningParser
from asyncstep.engine.chat.tool_parsers import tool_parser
from asyncstep.engine.chat.tools import ForcedCalls, check_tools
from asyncstep.engine.front_end.input_processor import InputProcessor, Prompt, check_request_id
from asyncstep.engine.front_end.output_thread import OutputThread, call_soon
from asyncstep.engine.front_end.request_state import RequestGroup, RequestState
from asyncstep.engine.messages.core_messages import (
    CoreFailed,
    CoreInputs,
    CoreOutputs,
    CoreReady,
    CoreStats,
    EngineCoreRequest,
    FromCore,
    Idle,
    Shutdown,
    ToCore,
    WaitIdle,
)
from asyncstep.engine.messages.outputs import (
    ChatChunk,
    ChatCompletion,
    ChatOutput,
    Completion,
    CompletionChunk,
)
from asyncstep.engine.transport.core_client import CoreClient
from asyncstep.errors import (
    EngineDeadError,
    EngineLoopError,
    InvalidRequestError,
    describe,
    error_from_core,
    leaves,
    root_cause,
)
from asyncstep.logging import get_logger
from asyncstep.logging.spans import span
from asyncstep.models.config import ModelArchConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = get_logger("engine")


@dataclass(frozen=True)
class EngineStatistics:
    num_running_reqs: int
    num_waiting_reqs: int
    num_steps: int
    num_preemptions: int
    num_generated_tokens: int
    num_finished_reqs: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_hit_rate: float
    #: Speculative decoding (0 and [] while off): request-steps verified with
    #: drafts, their draft tokens, the drafts accepted, and per draft position
    #: the drafts accepted there (over ``spec_decode_num_drafts``: that
    #: position's acceptance rate).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Draft tokens accepted over proposed (0 before any)."""
        drafts = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0


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
        #: Guards what the output processing shares with the callers: the
        #: requests in flight, their states, their waiters, the wake-ups.
        self._lock = threading.Lock()
        #: Core request id -> its state (one per choice).
        self._requests: dict[str, RequestState] = {}
        #: Waiters to wake (under the lock), delivered once per batch of news.
        self._wakeups: list[anyio.Event] = []
        #: Decodes the core's frames (a transport forwards them undecoded).
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        #: The caller's request id -> its choices.
        self._groups: dict[str, RequestGroup] = {}
        self._ids = itertools.count()
        #: Generated request ids start with it (front ends of one core differ).
        self._id_prefix = request_id_prefix
        self._to_core: MemoryObjectSendStream[ToCore] | None = None
        self._core_stats = CoreStats()
        #: Process ids of the rank processes (none when the rank runs in the core).
        self.rank_pids: list[int] = []
        #: The weight bytes a forward step reads, by its size (the floor of
        #: a memory-bound step; ``asyncstep bench``'s): the core's report.
        self.weight_reads: WeightReads | None = None
        self._idle_waiters: dict[int, anyio.Event] = {}
        self._tickets = itertools.count()
        self._error: BaseException | None = None
        #: aclose() was called: nothing more goes to the core.
        self._closing = False
        self._closed = False
        self._stopped = anyio.Event()
        self._num_generated_tokens = 0
        self._num_finished = 0
        #: The event loop it serves on (set by serve()), its thread, and where
        #: that is, in words.
        self._loop: anyio.lowlevel.EventLoopToken | None = None
        self._loop_thread: int | None = None
        self._loop_where = ""

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
        ids, params, reader = await self._chat_request(
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
        outputs = []
        for output in completion.outputs:
            reply = reader.whole(output.text)
            outputs.append(
                ChatOutput(
                    index=output.index,
                    content=reply.content,
                    reasoning_content=reply.reasoning,
                    tool_calls=reply.calls or [],
                    finish_reason=str(
                        finish_reason(str(output.finish_reason), reply.calls is not None)
                    ),
                    stop_reason=output.stop_reason,
                    text=output.text,
                    token_ids=output.token_ids,
                    logprobs=output.logprobs,
                )
            )
        return ChatCompletion(
            request_id=completion.request_id,
            prompt_token_ids=completion.prompt_token_ids,
            outputs=outputs,
        )

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
        ids, params, reader = await self._chat_request(
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
                yield ChatChunk(
                    request_id=chunk.request_id,
                    index=chunk.index,
                    content=piece.content,
                    reasoning_content=piece.reasoning,
                    tool_calls=piece.calls,
                    token_ids=piece.token_ids,
                    finish_reason=piece.finish_reason,
                    stop_reason=chunk.stop_reason,
                    logprobs=piece.logprobs,
                )

    async def _chat_request(
        self,
        messages: object,
        params: SamplingParams | None,
        tools: object,
        tool_choice: object,
        parallel_tool_calls: object,
        tool_call_parser: str | None,
        chat_template: str | None,
        chat_template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[list[int], SamplingParams, ReplyReader]:
        """A chat checked whole (the door's checks of the HTTP API's too):
        its prompt's ids, its sampling parameters (a forced call's grammar
        in them), and how its replies are read."""
        if not is_chat(messages):
            raise InvalidRequestError(
                f"messages must be a non-empty list of chat messages (dicts), got {shown(messages)}"
            )
        chat = cast(Sequence[Mapping[str, Any]], messages)
        checked = self.input_processor.check_params(params)
        mode = check_tools(
            tools, tool_choice, parallel_tool_calls, chat, tool_parser(tool_call_parser)
        )
        if isinstance(mode, ForcedCalls):
            if checked.structured_outputs is not None:
                raise InvalidRequestError(
                    "a forced tool call (tool_choice required or a named function) cannot be "
                    "combined with structured_outputs"
                )
            checked = msgspec.structs.replace(checked, structured_outputs=mode.structured_outputs())
        ids = await self.input_processor.encode_prompt(
            chat,
            tools=cast(Sequence[Mapping[str, Any]] | None, tools),
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
        )
        return ids, checked, ReplyReader(mode, ReasoningParser.of(self.config))

    def abort(self, request_id: str) -> None:
        """Abort a request in flight, every choice of it (no-op when it
        already ended)."""
        self._check_loop()
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {shown(request_id)}")
        group = self._groups.get(request_id)
        if group is not None:
            self._abort_group(group)

    async def wait_idle(self) -> None:
        """Wait until no step is in flight and nothing is left to schedule:
        aborted and finished requests have given back their blocks (they
        wait for the steps in flight that use them)."""
        self._check_loop()
        self._check_alive()
        ticket = next(self._tickets)
        with self._lock:
            event = self._idle_waiters[ticket] = anyio.Event()
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
        with self._lock:
            core = self._core_stats
            num_generated_tokens, num_finished = self._num_generated_tokens, self._num_finished
        return EngineStatistics(
            num_running_reqs=core.num_running_reqs,
            num_waiting_reqs=core.num_waiting_reqs,
            num_steps=core.num_steps,
            num_preemptions=core.num_preemptions,
            num_generated_tokens=num_generated_tokens,
            num_finished_reqs=num_finished,
            kv_cache_usage=core.kv_cache_usage,
            num_kv_blocks=core.num_kv_blocks,
            prefix_cache_hit_rate=core.prefix_cache_hit_rate,
            spec_decode_num_drafts=core.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=core.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=core.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(
                core.spec_decode_num_accepted_tokens_per_pos
            ),
        )

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the engine, if one did."""
        return self._error

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
        leaves nothing behind.

        ``n`` > 1: one core request per choice, ids ``{request_id}-{i}``,
        choice ``i`` seeded with ``seed + i``. With prefix caching the first
        choice goes alone, and the others once it has its first token (its
        prompt's blocks are then cached: the others reuse them, vLLM's
        parallel sampling)."""
        self._check_alive()
        params = self.input_processor.check_params(params, len(ids))
        request_id = self._check_request_id(request_id)
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        if not isinstance(client, str):
            raise InvalidRequestError(f"client must be a string, got {shown(client)}")
        group = RequestGroup(request_id, client, lock=self._lock, wakeups=self._wakeups)
        text = prompt if isinstance(prompt, str) else None
        for i, child_id in enumerate(child_ids):
            child = params if n == 1 else _choice_params(params, i)
            group.states.append(
                RequestState(
                    child_id, text, ids, child, self.tokenizer,
                    index=i, group=group, streamed=streamed,
                )
            )  # fmt: skip
        first, *others = group.states
        held = bool(others) and self.config.cache.enable_prefix_caching
        with self._lock:
            taken = [c for c in child_ids[1:] if c in self._requests]
            if taken:
                raise InvalidRequestError(f"request id {taken[0]!r} is already in flight")
            for state in group.states:
                state.sent = not held or state is first
                self._requests[state.request_id] = state
        self._groups[request_id] = group
        sent = [first] if held else group.states
        self._send(CoreInputs(new_requests=[_core_request(s) for s in sent]))
        return group

    def _send_held(self, group: RequestGroup) -> None:
        """Send the choices that waited for the first one's prompt."""
        held = [s for s in group.states if not s.sent and not s.ended]
        for state in group.states:
            state.sent = True
        if held:
            self._send(CoreInputs(new_requests=[_core_request(s) for s in held]))

    def _check_request_id(self, request_id: object) -> str:
        if request_id is None:
            return f"{self._id_prefix}{next(self._ids)}"
        request_id = check_request_id(request_id)
        with self._lock:
            in_flight = request_id in self._requests
        if in_flight or request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        return request_id

    def _abort_group(self, group: RequestGroup) -> None:
        """Abort every choice still running; forget the group."""
        self._groups.pop(group.request_id, None)
        aborted = []
        with self._lock:
            for state in group.states:
                if state.finished or state.error is not None:
                    continue
                self._requests.pop(state.request_id, None)
                state.abort()
                if state.sent:
                    aborted.append(state.request_id)
        self._deliver_wakeups()
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
        """Queue a message for the core (unbounded: never waits); dropped
        once the engine is closing (the core then ends every request). From
        the output thread it is handed to the loop first."""
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            call_soon(self._loop, self._send, message)
            return
        if self._closing or self._closed or self._to_core is None:
            return
        self._put_to_core(message)

    def _put_to_core(self, message: ToCore) -> None:
        """Queue ``message`` for the core; if the core's side has already
        gone (it died; :meth:`serve` is unwinding and reports why), drop it."""
        assert self._to_core is not None
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._to_core.send_nowait(message)

    def _check_loop(self) -> None:
        """Raise :class:`EngineLoopError` unless called on the event loop the
        engine serves on (in that loop's thread)."""
        if self._loop is None or self._closed:
            return  # not serving (yet, or any more): its calls fail as such
        try:
            token: anyio.lowlevel.EventLoopToken | None = anyio.lowlevel.current_token()
        except anyio.NoEventLoopError:
            token = None
        if token is None or token.native_token is not self._loop.native_token:
            raise EngineLoopError(
                f"this engine serves {self._loop_where} and was called from "
                f"{_where(token)}: call it on its own loop (from another thread, through "
                "anyio.from_thread.run or a BlockingPortal), or use asyncstep.LLM, the "
                "blocking API"
            )

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {describe(self._error)}") from self._error
        if self._closed or self._closing:
            raise EngineDeadError("the engine is closed")

    # -- serving ----------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the engine core, then hand its outputs to the requests until
        it stops. A failure while starting is raised; a failure later ends
        every request in flight with :class:`EngineDeadError`."""
        self._loop = anyio.lowlevel.current_token()
        self._loop_thread = threading.get_ident()
        self._loop_where = _where(self._loop)
        to_core_tx, to_core_rx = anyio.create_memory_object_stream[ToCore](math.inf)
        from_core_tx, from_core_rx = anyio.create_memory_object_stream[FromCore | bytes](math.inf)
        self._to_core = to_core_tx
        started = False
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.core.run, to_core_rx, from_core_tx)
                self._take_ready(await from_core_rx.receive())
                started = True
                task_status.started()
                await self._read_core(from_core_rx)
        except BaseException as exc:
            found = leaves(exc)
            cancelled = anyio.get_cancelled_exc_class()
            if any(not isinstance(e, Exception | cancelled) for e in found):
                # Ctrl-C (or SystemExit) reached a task: not an engine failure.
                self._die(EngineDeadError("the engine was interrupted"))
                raise
            errors = [e for e in found if isinstance(e, Exception)]
            if not errors:
                raise  # plain cancellation: the engine is being closed
            error = root_cause(exc)
            if not started:
                raise error from error.__cause__
            self._die(error)
        finally:
            self._closed = True
            to_core_tx.close()
            with self._lock:
                for state in self._requests.values():
                    state.fail(self._error or EngineDeadError("the engine is closed"))
                self._requests.clear()
                self._wakeups.extend(self._idle_waiters.values())
                self._idle_waiters.clear()
            self._deliver_wakeups()
            self._stopped.set()

    async def wait_stopped(self) -> None:
        """Wait until the engine has stopped: closed, or dead (then
        :attr:`error` says why)."""
        await self._stopped.wait()

    async def aclose(self, timeout_s: float = 10.0) -> bool:
        """Stop after the steps in flight: requests still running fail with
        :class:`EngineDeadError`, the ranks are told to shut down. Returns
        False if that took longer than ``timeout_s`` (the caller then cancels)."""
        self._check_loop()
        if self._to_core is not None and not (self._closing or self._closed):
            self._put_to_core(Shutdown())
            self._to_core.close()
        self._closing = True
        with anyio.move_on_after(timeout_s):
            await self._stopped.wait()
            return True
        return False

    async def _read_core(self, from_core: MemoryObjectReceiveStream[FromCore | bytes]) -> None:
        """Hand the core's messages to the output thread, each batch already
        queued at once, until the core stops; the thread's error is raised."""
        assert self._loop is not None
        loop = self._loop
        with anyio.CancelScope() as scope:

            def failed(_: BaseException) -> None:  # on the thread: stop reading
                call_soon(loop, scope.cancel)

            thread = OutputThread[FromCore | bytes](self._take_messages, failed)
            thread.start()
            try:
                async with from_core:
                    async for message in from_core:
                        thread.put([message, *_queued(from_core)])
            finally:
                thread.stop()
                with anyio.CancelScope(shield=True):
                    await thread.join()
        if thread.error is not None:
            raise thread.error

    def _take_messages(self, messages: list[FromCore | bytes]) -> None:
        """Process a batch of the core's messages (on the output thread),
        then wake the callers whose news are in it; CoreFailed (after the
        messages before it) is raised."""
        failed: CoreFailed | None = None
        with self._lock:
            for item in messages:
                message = self._decode(item) if isinstance(item, bytes) else item
                if isinstance(message, CoreOutputs):
                    with span("output", "frontend", step=message.step_id):
                        self._process_outputs(message)
                elif isinstance(message, Idle):
                    self._core_stats = message.stats
                    event = self._idle_waiters.pop(message.ticket, None)
                    if event is not None:
                        self._wakeups.append(event)
                elif isinstance(message, CoreFailed):
                    failed = message
                    break
        self._deliver_wakeups()
        if failed is not None:
            raise error_from_core(failed.error, failed.kind)

    def _decode(self, frame: bytes) -> FromCore:
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"bad message from the engine core: {exc}") from None

    def _deliver_wakeups(self) -> None:
        """Wake the waiters that news (or an end) reached: at once on the
        loop, else in one call handed to it."""
        with self._lock:
            wakeups = self._wakeups[:]
            self._wakeups.clear()
        if not wakeups:
            return
        if self._loop is None or threading.get_ident() == self._loop_thread:
            _set_all(wakeups)
        else:
            call_soon(self._loop, _set_all, wakeups)

    def _take_ready(self, item: FromCore | bytes) -> None:
        """The core's first message: CoreReady (the core sends it before it
        reports started)."""
        message = self._decode(item) if isinstance(item, bytes) else item
        if isinstance(message, CoreFailed):
            raise error_from_core(message.error, message.kind)
        if not isinstance(message, CoreReady):
            raise EngineDeadError(f"the engine core sent {type(message).__name__} first")
        self._core_stats = message.stats
        self.rank_pids = message.rank_pids
        self.weight_reads = message.weight_reads

    def _process_outputs(self, message: CoreOutputs) -> None:
        """A step's news into the requests' states (under the lock)."""
        self._core_stats = message.stats
        requests = self._requests
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
            self._num_generated_tokens += len(state.token_ids) - num_before
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
                self._num_finished += 1
                del requests[news.request_id]
        if stopped:
            self._send(CoreInputs(stopped=stopped))

    def _die(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            log.error("engine stopped", error=describe(error))


def _set_all(events: list[anyio.Event]) -> None:
    for event in events:
        event.set()


def _queued(
    stream: MemoryObjectReceiveStream[FromCore | bytes],
) -> list[FromCore | bytes]:
    """Every message already queued on ``stream``, without waiting."""
    queued: list[FromCore | bytes] = []
    with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):
        while True:
            queued.append(stream.receive_nowait())
    return queued


def _where(token: anyio.lowlevel.EventLoopToken | None) -> str:
    """The event loop of ``token`` (the current thread's), in words."""
    thread = threading.current_thread().name
    if token is None:
        return f"thread {thread!r}, which runs no event loop"
    return f"the {sniffio.current_async_library()} event loop of thread {thread!r}"


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
