"""A chat reply read apart: its thinking (a reasoning parser's), its answer,
and its tool calls (forced by a grammar, or found by ``auto``'s parser),
whole (:meth:`ReplyReader.whole`) or piece by piece as it streams
(:class:`ReplyStream`), and in a chat's shapes (:func:`chat_completion`,
:func:`chat_chunk`). ``Engine.chat`` and the HTTP server's chat responses
both read replies through it. A stream has no empty piece: a
chunk that brings nothing to show (text held back, a forced call not yet
complete) is left out, its tokens and log-probs going with the next piece
(:meth:`ReplyStream.take`).

The thinking comes first: with a reasoning parser, the calls are read from
the answer after it (a forced call's grammar holds from the end of the
thinking on: :mod:`asyncstep.engine.structured_output.reasoning_gate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncstep.datatypes import Logprobs
from asyncstep.engine.chat.reasoning import ReasoningParser, ReasoningStream
from asyncstep.engine.chat.tool_parsers import ParserStream, ToolParser
from asyncstep.engine.chat.tools import ForcedCalls, ToolCallStream, ToolMode
from asyncstep.engine.messages.outputs import (
    ChatChunk,
    ChatCompletion,
    ChatOutput,
    Completion,
    CompletionChunk,
    DeltaToolCall,
    ToolCall,
)

#: The finish reason of a reply that ended as calls.
TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class Reply:
    """A whole reply read apart (None where empty)."""

    reasoning: str | None
    content: str | None
    #: None: the reply holds no call.
    calls: list[ToolCall] | None


@dataclass(frozen=True)
class ReplyReader:
    """How one request's replies are read: as calls (``tools``: forced, or
    ``auto``'s parser; None: no calls), after the thinking (``reasoning``:
    None, no thinking apart)."""

    tools: ToolMode = None
    reasoning: ReasoningParser | None = None

    def whole(self, text: str) -> Reply:
        """A whole reply's thinking, answer and calls."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.split(text)
        mode, calls = self.tools, None
        if isinstance(mode, ForcedCalls):  # the answer is the calls alone
            calls = mode.calls(content or "")
            content = None if calls is not None else content
            calls = calls or None
        elif mode is not None:
            parsed = mode.parse(content or "")
            content, calls = parsed.content, parsed.calls or None
        return Reply(reasoning, content, calls)

    def stream(self) -> ReplyStream:
        """A stream for one choice."""
        return ReplyStream(self)


@dataclass(frozen=True)
class ReplyPiece:
    """The next piece of one choice's reply (None where empty), the tokens
    since the previous piece, and (the last) its finish reason."""

    reasoning: str | None
    content: str | None
    calls: list[DeltaToolCall] | None
    token_ids: list[int]
    logprobs: list[Logprobs] | None
    finish_reason: str | None


@dataclass
class ReplyStream:
    """One choice's reply, piece by piece: each piece's thinking, answer
    and call deltas (text that may be the start of a marker is held back)."""

    reader: ReplyReader
    #: Whether a call was seen (its finish reason is then ``tool_calls``).
    called: bool = False
    _thinking: ReasoningStream | None = None
    _calls: ToolCallStream | ParserStream | None = None
    #: Tokens and log-probs of the chunks left out since the last piece.
    _token_ids: list[int] = field(default_factory=list)
    _logprobs: list[Logprobs] | None = None

    def __post_init__(self) -> None:
        reader = self.reader
        if reader.reasoning is not None:
            self._thinking = reader.reasoning.stream()
        if isinstance(reader.tools, ForcedCalls):
            self._calls = ToolCallStream(reader.tools)
        elif isinstance(reader.tools, ToolParser):
            self._calls = reader.tools.stream()

    def take(self, chunk: CompletionChunk, *, keep_empty: bool = False) -> ReplyPiece | None:
        """The piece of the reply ``chunk`` brings, or None when it brings
        nothing to show and does not end the reply (``keep_empty``: a piece
        even then); the tokens of the chunks left out come with the next."""
        finished = chunk.finish_reason is not None
        reasoning, content, calls = self.feed(chunk.text, finished)
        self._token_ids += chunk.token_ids
        if chunk.logprobs is not None:
            self._logprobs = [*(self._logprobs or ()), *chunk.logprobs]
        if not (reasoning or content or calls or finished or keep_empty):
            return None
        reason = None if chunk.finish_reason is None else str(chunk.finish_reason)
        piece = ReplyPiece(
            reasoning,
            content,
            calls,
            self._token_ids,
            self._logprobs,
            finish_reason(reason, self.called),
        )
        self._token_ids, self._logprobs = [], None
        return piece

    def feed(
        self, text: str, finished: bool
    ) -> tuple[str | None, str | None, list[DeltaToolCall] | None]:
        """The (thinking, answer, call deltas) of the next piece of the
        reply (``finished``: it is the last)."""
        reasoning: str | None = None
        content: str | None = text
        if self._thinking is not None:
            reasoning, content = self._thinking.feed(text, finished)
        calls: list[DeltaToolCall] | None = None
        if isinstance(self._calls, ToolCallStream):
            if content is None and not finished:
                return reasoning, None, None  # the answer has not started
            calls, content = self._calls.delta(content or "", finished)
        elif self._calls is not None:
            content, calls = self._calls.feed(content or "", finished)
        if self._calls is not None:
            self.called = self._calls.num_calls > 0
        return reasoning, content, calls


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A reply's finish reason: ``tool_calls`` where it ended as calls (a
    stop), else the engine's (``length``: cut short)."""
    return TOOL_CALLS if called and reason == "stop" else reason


def chat_completion(completion: Completion, reader: ReplyReader) -> ChatCompletion:
    """``Engine.chat``'s answer: ``completion``'s choices read apart by ``reader``."""
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


def chat_chunk(chunk: CompletionChunk, piece: ReplyPiece) -> ChatChunk:
    """``Engine.chat_stream``'s chunk: the ``piece`` of a reply that
    ``chunk`` brought (:meth:`ReplyStream.take`)."""
    return ChatChunk(
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
