"""Reasoning parsers (the engine's ``reasoning_parser``, ``--reasoning-parser``):
a reply's thinking, between
``<think>`` and ``</think>``, goes to ``reasoning_content``, apart from its
``content``, whole (:meth:`ReasoningParser.split`) and streamed
(:class:`ReasoningStream`: text that may be the start of ``</think>`` is held
back until it is known).

* ``qwen3``: thinking only where the reply opens with ``<think>`` (else it
  is all content: thinking switched off);
* ``deepseek_r1``: the template opens the thinking in the prompt, so the reply
  is thinking up to ``</think>`` (a leading ``<think>`` is dropped).

Thinking that was opened and not ended (cut short) is all reasoning.

A request's grammar (structured outputs, forced tool calls) applies to the
answer only, from the end of the thinking on
(:mod:`asyncstep.engine.structured_output.reasoning_gate`, in the engine core).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncstep.config import REASONING_PARSERS
from asyncstep.engine.messages.markers import END, START, held_back

if TYPE_CHECKING:
    from asyncstep.config import EngineConfig


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    #: Whether a reply that does not open with ``<think>`` thinks all the
    #: same (deepseek_r1: its prompt opened the thinking).
    unended_is_reasoning: bool

    @classmethod
    def named(cls, name: str) -> ReasoningParser:
        """The parser ``--reasoning-parser name`` names (qwen3, deepseek_r1)."""
        assert name in REASONING_PARSERS, name
        return cls(name, unended_is_reasoning=name == "deepseek_r1")

    @classmethod
    def of(cls, config: EngineConfig) -> ReasoningParser | None:
        """The engine's parser (``structured_outputs.reasoning_parser``; None: none)."""
        name = config.structured_outputs.reasoning_parser
        return None if name is None else cls.named(name)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply's (reasoning, content); None where empty."""
        stripped = text.lstrip()
        opened = stripped.startswith(START)
        if not opened and not self.unended_is_reasoning:
            return None, text or None  # qwen3: no <think>, no thinking
        body = stripped[len(START) :] if opened else text
        reasoning, ended, content = body.partition(END)
        if not ended:  # thinking cut short
            return body.strip() or None, None
        return reasoning.strip() or None, content.lstrip() or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


@dataclass
class ReasoningStream:
    """One choice's reply, piece by piece (see the module doc)."""

    parser: ReasoningParser
    _held: str = ""
    _thinking: bool | None = None  # None: not known yet
    _ended: bool = False

    def feed(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """The (reasoning, content) of the next piece of the reply."""
        if self._ended:
            return None, text or None
        self._held += text
        if self._thinking is None:
            lead = self._held.lstrip()
            if lead.startswith(START):
                self._held, self._thinking = lead[len(START) :], True
            elif lead and START.startswith(lead) and not finished:
                return None, None  # may still become <think>
            elif not lead and not finished:
                return None, None
            elif self.parser.unended_is_reasoning:
                self._thinking = True
            else:  # qwen3 without <think>: all content
                self._ended = True
                held, self._held = self._held, ""
                return None, held or None
        at = self._held.find(END)
        if at >= 0:
            reasoning, content = self._held[:at], self._held[at + len(END) :].lstrip()
            self._held, self._ended = "", True
            return reasoning.strip() or None, content or None
        if finished:  # thinking cut short
            held, self._held = self._held.rstrip(), ""
            return held or None, None
        keep = held_back(self._held, END)
        cut = len(self._held) - keep
        reasoning, self._held = self._held[:cut], self._held[cut:]
        return reasoning or None, None
