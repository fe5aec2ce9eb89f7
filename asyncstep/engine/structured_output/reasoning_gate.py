"""A grammar after the thinking (vLLM's ``reasoning_parser.is_reasoning_end``
in its structured-output manager): with the engine's ``reasoning_parser``
on, a request's grammar (structured outputs, forced tool calls) applies to
its answer only. While the model thinks, its bitmask rows allow every
token and its matcher sees nothing; from the end of the thinking
(``</think>``) on, the matcher takes the tokens.

The end is found in the output's bytes (each token's bytes, as the grammar's
vocabulary decodes them), so a marker that is one token (Qwen3's,
DeepSeek-R1's) or several (a model without such a token) ends the thinking
alike; the bytes after the marker in the token that ends it go to the
matcher as a string. Where a request starts (:meth:`ReasoningMarkers.gate`)
follows the parsers' reading of the text (:mod:`asyncstep.engine.chat.reasoning`):
the prompt's last marker first (``</think>``: the template closed the
thinking, e.g. Qwen3's ``enable_thinking=False``: the grammar holds from the
first token; ``<think>``: the template opened it); else ``deepseek_r1``
thinks from the first token, and ``qwen3`` only where the reply opens with
its ``<think>`` token: the first row allows the grammar's tokens and that
one (a vocabulary whose ``<think>`` is not one token cannot open it there:
the grammar holds from the first token).

Drafts (speculative decoding) never cross the end of the thinking
(:meth:`ReasoningGate.valid_drafts`): the token that ends it is always the
step's own, so every row of a thinking request allows everything, and the
matcher starts on the tokens the scheduler accepted. Imports the markers of
:mod:`asyncstep.engine.messages.markers` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from asyncstep.engine.messages.markers import END, START

#: :meth:`ReasoningGate.feed`'s answer for a token the thinking took.
THINKING = None


@dataclass(frozen=True)
class ReasoningMarkers:
    """The thinking's markers in one vocabulary (``token_bytes``: each
    token id's bytes)."""

    parser: str
    token_bytes: Sequence[bytes]
    start: bytes = START.encode()
    end: bytes = END.encode()

    @cached_property
    def start_token(self) -> int | None:
        """The token that is ``<think>`` alone, if the vocabulary has one."""
        return _single_token(self.token_bytes, self.start)

    def gate(self, prompt_token_ids: Sequence[int]) -> ReasoningGate | None:
        """The gate of a request with this prompt (see the module doc);
        None: its grammar holds from the first token."""
        prompt = b"".join(self._bytes(t) for t in prompt_token_ids)
        last_start, last_end = prompt.rfind(self.start), prompt.rfind(self.end)
        if last_end > last_start:
            return None  # the template ended the thinking
        if last_start >= 0 or self.parser == "deepseek_r1":
            return ReasoningGate(self)
        start_token = self.start_token
        if start_token is None:
            return None
        return ReasoningGate(self, opening=start_token)

    def _bytes(self, token_id: int) -> bytes:
        return self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""


def _single_token(token_bytes: Sequence[bytes], text: bytes) -> int | None:
    for token_id, value in enumerate(token_bytes):
        if value == text:
            return token_id
    return None


@dataclass
class ReasoningGate:
    """One request's thinking, until it ends (see the module doc).
    ``opening``: the reply has not started; it thinks only if it opens with
    this token (qwen3)."""

    markers: ReasoningMarkers
    opening: int | None = None
    #: The thinking's last bytes (as many as the end marker may need).
    _tail: bytes = b""
    #: The thinking ended: the matcher takes every token from now on.
    ended: bool = False

    def feed(self, token_id: int) -> int | bytes | None:
        """Take the next output token: :data:`THINKING` (None) while the
        thinking goes on; the bytes after the end marker in this token
        (the matcher accepts them as a string, b"" for none) when it ends
        the thinking; the token itself (an int: the matcher accepts it) when
        the reply does not open with ``<think>``."""
        if self.opening is not None:
            opening, self.opening = self.opening, None
            if token_id == opening:
                return THINKING
            self.ended = True
            return token_id
        text = self._tail + self.markers._bytes(token_id)
        at = text.find(self.markers.end)
        if at >= 0:
            self.ended = True
            return text[at + len(self.markers.end) :]
        self._tail = text[-(len(self.markers.end) - 1) :]
        return THINKING

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` that stays inside the thinking
        (none before the reply opens); the gate is left as it was."""
        if self.ended or self.opening is not None:
            return [] if self.opening is not None else drafts
        tail = self._tail
        for i, token_id in enumerate(drafts):
            text = tail + self.markers._bytes(token_id)
            if self.markers.end in text:
                return drafts[:i]
            tail = text[-(len(self.markers.end) - 1) :]
        return drafts
