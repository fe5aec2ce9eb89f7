"""Engine output as OpenAI response bodies: a whole completion or chat
completion (:meth:`Formatter.whole`), or the stream chunks of one
(:meth:`Formatter.chunk`), with log-probs in each endpoint's shape and the
token counts (``usage``).

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
from asyncstep.engine.outputs import CompletionChunk
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


class Formatter(Protocol):
    """One endpoint's response bodies."""

    def whole(self, choices: list[ChoiceOutput], usage: UsageInfo) -> msgspec.Struct: ...

    def chunk(
        self, index: int, chunk: CompletionChunk, first: bool, usage: UsageInfo | None
    ) -> msgspec.Struct: ...

    def usage_chunk(self, usage: UsageInfo) -> msgspec.Struct: ...


@dataclass
class CompletionFormatter:
    """``/v1/completions`` bodies; ``echo`` puts each prompt's text (by
    choice) before its output."""

    request_id: str
    created: int
    model: str
    texts: TokenTexts
    logprobs: bool
    echo_texts: list[str] | None = None

    def whole(self, choices: list[ChoiceOutput], usage: UsageInfo) -> CompletionResponse:
        out = []
        for i, choice in enumerate(choices):
            prefix = self._echo(i)
            out.append(
                CompletionChoice(
                    index=i,
                    text=prefix + choice.text,
                    logprobs=self._logprobs(choice.logprobs, len(prefix)),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return self._body(out, usage)

    def chunk(
        self, index: int, chunk: CompletionChunk, first: bool, usage: UsageInfo | None
    ) -> CompletionResponse:
        prefix = self._echo(index) if first else ""
        choice = CompletionChoice(
            index=index,
            text=prefix + chunk.text,
            logprobs=self._logprobs(chunk.logprobs or [], 0),
            finish_reason=None if chunk.finish_reason is None else str(chunk.finish_reason),
            stop_reason=chunk.stop_reason,
        )
        return self._body([choice], usage)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._body([], usage)

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _echo(self, index: int) -> str:
        return "" if self.echo_texts is None else self.echo_texts[index]

    def _logprobs(self, entries: list[Logprobs], offset: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        out = CompletionLogprobs()
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
        return out


@dataclass
class ChatFormatter:
    """``/v1/chat/completions`` bodies."""

    request_id: str
    created: int
    model: str
    texts: TokenTexts
    logprobs: bool

    def whole(self, choices: list[ChoiceOutput], usage: UsageInfo) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                ChatChoice(
                    index=i,
                    message=ChatMessageOut(content=choice.text),
                    logprobs=self._logprobs(choice.logprobs),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for i, choice in enumerate(choices)
            ],
            usage=usage,
        )

    def chunk(
        self, index: int, chunk: CompletionChunk, first: bool, usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        choice = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(role="assistant" if first else None, content=chunk.text),
            logprobs=self._logprobs(chunk.logprobs or []),
            finish_reason=None if chunk.finish_reason is None else str(chunk.finish_reason),
            stop_reason=chunk.stop_reason,
        )
        return self._chunk([choice], usage)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(
        self, choices: list[ChatStreamChoice], usage: UsageInfo | None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

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
