"""The engine's view of one request in flight: its detokenizer, what it has
produced so far, and the channel its chunks go out on."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import anyio

from asyncstep.datatypes import FinishReason, Logprobs, SamplingParams
from asyncstep.engine.detokenizer import IncrementalDetokenizer
from asyncstep.engine.outputs import Completion, CompletionChunk

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
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        #: Why the request cannot finish (the engine died or closed), if so.
        self.error: BaseException | None = None
        # Unbounded: a slow reader never holds the engine's loop up.
        self.chunks_tx, self.chunks_rx = anyio.create_memory_object_stream[CompletionChunk](
            math.inf
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_output(
        self,
        new_token_ids: list[int],
        new_logprobs: list[Logprobs] | None,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> str | None:
        """Record a step's news; returns a stop string the text reached, if any
        (the request then finishes with reason ``stop``)."""
        self.token_ids.extend(new_token_ids)
        if self.logprobs is not None and new_logprobs:
            self.logprobs.extend(new_logprobs)
        stop_string = self.detokenizer.update(new_token_ids)
        if stop_string is not None:
            finish_reason, stop_reason = FinishReason.STOP, stop_string
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        chunk = CompletionChunk(
            request_id=self.request_id,
            text=self.detokenizer.next_delta(self.finished),
            token_ids=list(new_token_ids),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=list(new_logprobs) if new_logprobs else None,
        )
        self.chunks_tx.send_nowait(chunk)
        if self.finished:
            self.chunks_tx.close()
        return stop_string

    def fail(self, error: BaseException) -> None:
        """End the request's stream with an error (the engine stopped)."""
        self.error = error
        self.chunks_tx.close()

    def abort(self) -> None:
        self.finish_reason = FinishReason.ABORT
        self.chunks_tx.close()

    def completion(self) -> Completion:
        assert self.finish_reason is not None
        return Completion(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.detokenizer.output_text,
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
        )
