"""What a caller gets back: a finished :class:`Completion` (its
:class:`CompletionOutput` choices), or the :class:`CompletionChunk` deltas
of a stream."""

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
