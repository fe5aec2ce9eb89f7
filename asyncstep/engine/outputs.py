"""What a caller gets back: a finished :class:`Completion`, or the
:class:`CompletionChunk` deltas of a stream."""

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Completion(msgspec.Struct, frozen=True):
    """A finished request: its whole output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    #: The stop string or stop token id that ended it, if one did.
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
