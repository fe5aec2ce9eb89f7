"""Incremental detokenization and stop strings.

Tokens are decoded as they arrive with the tokenizers library's
``DecodeStream`` (the prompt's last tokens as context, so a first output
token keeps its leading space). Stop strings are searched in the new text
only, and not in the text of the first ``min_tokens`` tokens (vLLM's rule);
a match truncates the output, and :attr:`IncrementalDetokenizer.num_tokens_at_stop`
says how many output tokens made the text up to it (one step may bring
several tokens, e.g. accepted drafts: those after the stop are dropped).
While a request runs, a stream withholds
the last ``len(longest stop string) - 1`` characters, which may yet become the
start of a stop string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from asyncstep.datatypes import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Prompt tokens given to the decoder as context.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = (
            DecodeStream(prompt_token_ids[-CONTEXT_TOKENS:], True)
            if self._backend is not None
            else None
        )
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self._num_tokens = 0
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.output_text = ""
        self._sent = 0
        #: Once a stop string matched: the output tokens up to the one that
        #: completed it (the tokens after it reach no client).
        self.num_tokens_at_stop: int | None = None
        self._stop_end = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode new tokens; returns the stop string they completed, if any
        (the text is then cut at it)."""
        if self._stream is None or self._backend is None:
            return None
        start = len(self.output_text)
        first_token = self._num_tokens
        #: Text length after each new token (to find the token ending a stop).
        text_ends: list[int] = []
        for token in new_token_ids:
            self._num_tokens += 1
            if self._num_tokens == self.min_tokens + 1:
                start = len(self.output_text)  # stop strings count from this token on
            piece = self._stream.step(self._backend, token)
            if piece:
                self.output_text += piece
            text_ends.append(len(self.output_text))
        if not self.stop or self._num_tokens <= self.min_tokens:
            return None
        found = self._check_stop(start)
        if found is not None:
            at = self._stop_end
            kept = next((i for i, end in enumerate(text_ends, 1) if end >= at), len(text_ends))
            self.num_tokens_at_stop = first_token + kept
        return found

    def _check_stop(self, new_from: int) -> str | None:
        """The earliest stop string in the new text (a match may start in the
        last characters of the old text)."""
        found: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.output_text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (found is None or at < found[0]):
                found = (at, stop)
        if found is None:
            return None
        at, stop = found
        #: Where the match ends in the text before it was cut.
        self._stop_end = at + len(stop)
        self.output_text = self.output_text[: at + len(stop) if self.include_stop else at]
        return stop

    def next_delta(self, finished: bool) -> str:
        """Text not handed out yet (withholding a possible stop-string start)."""
        end = (
            len(self.output_text)
            if finished
            else max(self._sent, len(self.output_text) - self._holdback)
        )
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta
