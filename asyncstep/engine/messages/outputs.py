"""What a caller gets back: a finished :class:`Completion` (its
:class:`CompletionOutput` choices), or the :class:`CompletionChunk` deltas
of a stream; for a chat (``Engine.chat``), a :class:`ChatCompletion` (its
:class:`ChatOutput` choices: content, reasoning, :class:`ToolCall` s) or the
:class:`ChatChunk` deltas of a stream (:class:`DeltaToolCall` s), in
OpenAI's shapes."""

from __future__ import annotations

import msgspec

from asyncstep.datatypes import FinishReason, Logprobs


class CompletionChunk(msgspec.Struct, frozen=True):
    """New text and tokens of one request since its previous chunk.

    The last chunk of a request has ``finish_reason`` set.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    #: The choice the chunk belongs to (``0 .. n - 1``).
    index: int = 0
    #: In the first chunk of choice 0, when asked for: as ``Completion``'s.
    prompt_logprobs: list[Logprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class CompletionOutput(msgspec.Struct, frozen=True):
    """One choice of a finished request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    #: The stop string or stop token id that ended it, if one did.
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None


class Completion(msgspec.Struct, frozen=True):
    """A finished request: its whole output. ``outputs`` holds its ``n``
    choices; ``text``, ``token_ids``, ``finish_reason``, ``stop_reason`` and
    ``logprobs`` are those of ``outputs[0]``. ``prompt_logprobs``, when
    asked for, has one entry per prompt token: None for the first, then the
    prompt token's log-prob and the top-k of its position (vLLM's)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    #: The stop string or stop token id that ended it, if one did.
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    outputs: list[CompletionOutput] = msgspec.field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        outputs: list[CompletionOutput],
        prompt_logprobs: list[Logprobs | None] | None = None,
    ) -> Completion:
        """The completion of ``outputs`` (choice 0 first)."""
        first = outputs[0]
        return cls(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason=first.finish_reason,
            stop_reason=first.stop_reason,
            logprobs=first.logprobs,
            outputs=outputs,
            prompt_logprobs=prompt_logprobs,
        )


class FunctionCall(msgspec.Struct):
    name: str
    #: The arguments as a JSON text (OpenAI's).
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """A call an assistant made (a reply's, or one in a chat's history)."""

    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed call: its ``index`` among the choice's calls;
    ``id``, ``type`` and the name first, then pieces of the arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One choice of a finished chat: its text read apart into the thinking
    (``reasoning_content``: with a reasoning parser), the answer
    (``content``; None where empty) and the calls (``tool_calls``).
    ``finish_reason`` is ``tool_calls`` where the reply ended as calls,
    else the engine's (``stop``, ``length``, ``abort``)."""

    index: int
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    finish_reason: str
    stop_reason: int | str | None = None
    #: The whole reply's text (thinking and calls included) and tokens.
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[Logprobs] | None = None


class ChatCompletion(msgspec.Struct, frozen=True, kw_only=True):
    """A finished chat: its choices (``outputs``); ``content``,
    ``reasoning_content``, ``tool_calls`` and ``finish_reason`` are choice
    0's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[ChatOutput]

    @property
    def content(self) -> str | None:
        return self.outputs[0].content

    @property
    def reasoning_content(self) -> str | None:
        return self.outputs[0].reasoning_content

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.outputs[0].tool_calls

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


class ChatChunk(msgspec.Struct, frozen=True, kw_only=True):
    """What is new in one choice (``index``) of a streamed chat since its
    previous chunk, as OpenAI's deltas: thinking, answer, and call pieces
    (a call's id and name first, then its arguments). Text that may be the
    start of a marker (``</think>``, ``<tool_call>``) is held back until it
    is known. The last chunk of a choice has ``finish_reason``."""

    request_id: str
    index: int = 0
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
