"""Engine output as OpenAI response bodies: a whole completion or chat
completion (:meth:`Formatter.whole`), or the stream chunks of one
(:meth:`Formatter.chunk`), with log-probs in each endpoint's shape,
vLLM's ``prompt_logprobs`` and the token counts (``usage``).

Choice ``k`` of prompt ``i`` (of ``n``) is choice ``i * n + k`` of the
response. Log-probs of minus infinity are reported as -9999 (JSON has no
infinity); a token's text is its own decode (``token_id:N`` without a
tokenizer), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

from asyncstep.datatypes import Logprobs
from asyncstep.engine.chat.chat_replies import ReplyReader, ReplyStream, finish_reason
from asyncstep.engine.messages.outputs import CompletionChunk
from asyncstep.server.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprob,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
    UsageInfo,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: What a log-prob of minus infinity is reported as.
MIN_LOGPROB = -9999.0


class TokenTexts:
    """Each token's text (its own decode), cached: a vocabulary's worth at most."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = str(self._tokenizer.decode([token_id]))
            self._cache[token_id] = text
        return text


@dataclass
class ChoiceOutput:
    """One choice, gathered from its stream chunks."""

    texts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, chunk: CompletionChunk) -> None:
        self.texts.append(chunk.text)
        self.num_tokens += len(chunk.token_ids)
        if chunk.logprobs:
            self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = str(chunk.finish_reason)
            self.stop_reason = chunk.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # -inf and nan too


def prompt_logprob_entries(
    texts: TokenTexts, entries: list[Logprobs | None], k: int
) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: each position's prompt token (its rank
    among all tokens) and the top ``k`` (ranks 1 .. k), by token id."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        token = entry.token_ids[0]
        position = {
            str(token): PromptLogprob(
                logprob=_logprob(entry.logprobs[0]),
                rank=entry.sampled_token_rank,
                decoded_token=texts(token),
            )
        }
        tops = zip(entry.token_ids[1 : k + 1], entry.logprobs[1 : k + 1], strict=True)
        for rank, (t, value) in enumerate(tops, 1):
            position.setdefault(
                str(t), PromptLogprob(logprob=_logprob(value), rank=rank, decoded_token=texts(t))
            )
        out.append(position)
    return out


class Formatter(Protocol):
    """One endpoint's response bodies. ``prompt_logprobs`` (by prompt) are
    those the engine gave, when asked for."""

    def whole(
        self,
        choices: list[ChoiceOutput],
        usage: UsageInfo,
        prompt_logprobs: list[list[Logprobs | None] | None],
    ) -> msgspec.Struct: ...

    def chunk(
        self, index: int, chunk: CompletionChunk, first: bool, usage: UsageInfo | None
    ) -> msgspec.Struct | None:
        """A choice's chunk as a body; None: nothing to send (what it holds
        goes with the next)."""

    def usage_chunk(self, usage: UsageInfo) -> msgspec.Struct: ...


@dataclass
class CompletionFormatter:
    """``/v1/completions`` bodies. ``echo_texts`` (by prompt) go before each
    choice's output: with log-probs, the prompt's tokens come first in them
    (the first with none); ``hide_output``: the prompt alone (``echo`` with
    ``max_tokens`` 0). A stream's log-prob offsets count from the start of
    its choice's text."""

    request_id: str
    created: int
    model: str
    texts: TokenTexts
    #: Log-probs per position asked (None: none).
    logprobs: int | None
    n: int
    prompt_ids: list[list[int]]
    prompt_logprobs: int | None = None
    echo_texts: list[str] | None = None
    hide_output: bool = False
    #: Streams: each prompt's log-probs once seen, each choice's text offset.
    _seen_prompt_logprobs: dict[int, list[Logprobs | None]] = field(default_factory=dict)
    _offsets: dict[int, int] = field(default_factory=dict)

    def whole(
        self,
        choices: list[ChoiceOutput],
        usage: UsageInfo,
        prompt_logprobs: list[list[Logprobs | None] | None],
    ) -> CompletionResponse:
        out = []
        for index, choice in enumerate(choices):
            prompt = index // self.n
            lps = prompt_logprobs[prompt]
            logprobs = None
            if self.logprobs is not None:
                logprobs = CompletionLogprobs()
                offset = self._add_prompt(logprobs, prompt, lps, 0)
                if not self.hide_output:
                    self._add_output(logprobs, choice.logprobs, offset)
            out.append(
                CompletionChoice(
                    index=index,
                    text=self._echo(prompt) + ("" if self.hide_output else choice.text),
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_logprobs=self._prompt_entries(lps),
                )
            )
        return self._body(out, usage)

    def chunk(
        self, index: int, chunk: CompletionChunk, first: bool, usage: UsageInfo | None
    ) -> CompletionResponse:
        prompt = index // self.n
        if chunk.prompt_logprobs is not None:
            self._seen_prompt_logprobs[prompt] = chunk.prompt_logprobs
        lps = self._seen_prompt_logprobs.get(prompt)
        prefix = self._echo(prompt) if first else ""
        logprobs = None
        if self.logprobs is not None:
            logprobs = CompletionLogprobs()
            offset = self._offsets.get(index, 0)
            if first:
                offset = self._add_prompt(logprobs, prompt, lps, offset)
            if not self.hide_output:
                offset = self._add_output(logprobs, chunk.logprobs or [], offset)
            self._offsets[index] = offset
        choice = CompletionChoice(
            index=index,
            text=prefix + ("" if self.hide_output else chunk.text),
            logprobs=logprobs,
            finish_reason=None if chunk.finish_reason is None else str(chunk.finish_reason),
            stop_reason=chunk.stop_reason,
            prompt_logprobs=self._prompt_entries(chunk.prompt_logprobs),
        )
        return self._body([choice], usage)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._body([], usage)

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _echo(self, prompt: int) -> str:
        return "" if self.echo_texts is None else self.echo_texts[prompt]

    def _prompt_entries(self, entries: list[Logprobs | None] | None) -> PromptLogprobs | None:
        if self.prompt_logprobs is None or entries is None:
            return None
        return prompt_logprob_entries(self.texts, entries, self.prompt_logprobs)

    def _add_prompt(
        self,
        out: CompletionLogprobs,
        prompt: int,
        entries: list[Logprobs | None] | None,
        offset: int,
    ) -> int:
        """The echoed prompt's tokens (with their log-probs where known)."""
        if self.echo_texts is None:
            return offset
        k = self.logprobs or 0
        for position, token_id in enumerate(self.prompt_ids[prompt]):
            entry = entries[position] if entries is not None and position < len(entries) else None
            token = self.texts(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            value = _logprob(entry.logprobs[0])
            top = {
                self.texts(t): _logprob(v)
                for t, v in zip(entry.token_ids[1 : k + 1], entry.logprobs[1 : k + 1], strict=True)
            }
            top.setdefault(token, value)
            out.token_logprobs.append(value)
            out.top_logprobs.append(top)
        return offset

    def _add_output(self, out: CompletionLogprobs, entries: list[Logprobs], offset: int) -> int:
        for entry in entries:
            token = self.texts(entry.token_ids[0])
            value = _logprob(entry.logprobs[0])
            top = {
                self.texts(t): _logprob(v)
                for t, v in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
            }
            top.setdefault(token, value)  # the sampled token too, as vLLM lists it
            out.tokens.append(token)
            out.token_logprobs.append(value)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return offset


@dataclass
class ChatFormatter:
    """``/v1/chat/completions`` bodies (``prompt_logprobs`` at the top, as vLLM's)."""

    request_id: str
    created: int
    model: str
    texts: TokenTexts
    logprobs: bool
    prompt_logprobs: int | None = None
    #: How replies are read: their thinking apart, their calls
    #: (:mod:`asyncstep.engine.chat.chat_replies`).
    reader: ReplyReader = field(default_factory=ReplyReader)
    _streams: dict[int, ReplyStream] = field(default_factory=dict)

    def whole(
        self,
        choices: list[ChoiceOutput],
        usage: UsageInfo,
        prompt_logprobs: list[list[Logprobs | None] | None],
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(i, choice) for i, choice in enumerate(choices)],
            usage=usage,
            prompt_logprobs=self._prompt_entries(prompt_logprobs[0]),
        )

    def _choice(self, index: int, choice: ChoiceOutput) -> ChatChoice:
        reply = self.reader.whole(choice.text)
        message = ChatMessageOut(
            content=reply.content, reasoning_content=reply.reasoning, tool_calls=reply.calls or []
        )
        return ChatChoice(
            index=index,
            message=message,
            logprobs=self._logprobs(choice.logprobs),
            finish_reason=finish_reason(choice.finish_reason, reply.calls is not None),
            stop_reason=choice.stop_reason,
        )

    def chunk(
        self, index: int, chunk: CompletionChunk, first: bool, usage: UsageInfo | None
    ) -> ChatCompletionChunk | None:
        """The choice's next delta; None when it would be empty (the first,
        which has the role, never is)."""
        stream = self._streams.setdefault(index, self.reader.stream())
        piece = stream.take(chunk, keep_empty=first)
        if piece is None:
            return None
        delta = DeltaMessage(
            role="assistant" if first else None,
            content=piece.content,
            reasoning_content=piece.reasoning,
            tool_calls=piece.calls,
        )
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(piece.logprobs or []),
            finish_reason=piece.finish_reason,
            stop_reason=chunk.stop_reason,
        )
        body = self._chunk([choice], usage)
        body.prompt_logprobs = self._prompt_entries(chunk.prompt_logprobs)
        return body

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(
        self, choices: list[ChatStreamChoice], usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _prompt_entries(self, entries: list[Logprobs | None] | None) -> PromptLogprobs | None:
        if self.prompt_logprobs is None or entries is None:
            return None
        return prompt_logprob_entries(self.texts, entries, self.prompt_logprobs)

    def _logprobs(self, entries: list[Logprobs]) -> ChatChoiceLogprobs | None:
        if not self.logprobs:
            return None
        return ChatChoiceLogprobs(
            content=[
                ChatLogprob(
                    token=(token := self.texts(entry.token_ids[0])),
                    logprob=_logprob(entry.logprobs[0]),
                    bytes=list(token.encode()),
                    top_logprobs=[
                        self._top(t, v)
                        for t, v in zip(entry.token_ids[1:], entry.logprobs[1:], strict=True)
                    ],
                )
                for entry in entries
            ]
        )

    def _top(self, token_id: int, value: float) -> TopLogprob:
        token = self.texts(token_id)
        return TopLogprob(token=token, logprob=_logprob(value), bytes=list(token.encode()))
