"""Tool-call parsers for ``tool_choice: auto`` (``--tool-call-parser``):
the model chooses whether to call, and its calls are read from its text
(served by ``asyncstep serve --tool-call-parser`` and ``Engine.chat``'s
``tool_call_parser``).

A parser is a small class with a whole-text method (:meth:`ToolParser.parse`)
and a streaming one (:meth:`ToolParser.stream`, a :class:`ParserStream` fed
each piece of text). Streamed, text that may be the start of a call is held
back until it is known; a call comes as one delta (id, name and its whole
arguments) once it is complete. Text that turns out not to be a call is
content. Add one by subclassing and naming it in :data:`TOOL_PARSERS`.

* ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, any number, content around them;
* ``llama3_json`` (Llama 3.1+): the whole reply is one or more ``{"name": ...,
  "parameters": {...}}`` objects (``; `` between them), after an optional
  ``<|python_tag|>``; anything else is content.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from asyncstep.checks import shown
from asyncstep.engine.messages.markers import held_back
from asyncstep.engine.messages.outputs import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from asyncstep.errors import InvalidRequestError


@dataclass
class Parsed:
    """A reply read by a parser: its text outside calls (None: none), its calls."""

    content: str | None
    calls: list[ToolCall]


def new_call_id() -> str:
    """A fresh tool call id (OpenAI's shape: ``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: str, arguments: Any) -> ToolCall:
    """A call with a fresh id; ``arguments`` an object or its JSON text."""
    text = arguments if isinstance(arguments, str) else msgspec.json.encode(arguments).decode()
    return ToolCall(id=new_call_id(), function=FunctionCall(name, text))


def call_of(item: object, arguments_key: str) -> ToolCall | None:
    """``{"name": str, arguments_key: object}`` as a call, else None."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, {})
    if not isinstance(arguments, dict | str):
        return None
    return make_call(item["name"], arguments)


def as_deltas(calls: list[ToolCall], first_index: int) -> list[DeltaToolCall]:
    return [
        DeltaToolCall(
            first_index + i,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(call.function.name, call.function.arguments),
        )
        for i, call in enumerate(calls)
    ]


@dataclass
class ParserStream(ABC):
    """One choice's stream through a parser."""

    num_calls: int = 0

    @abstractmethod
    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """The content and the call deltas of the next piece of text
        (``finished``: it is the last)."""


class ToolParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> Parsed:
        """A whole reply's content and calls."""

    @abstractmethod
    def stream(self) -> ParserStream:
        """A stream for one choice."""


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> Parsed:
        content: list[str] = []
        calls: list[ToolCall] = []
        rest = text
        while (start := rest.find(self.START)) >= 0:
            end = rest.find(self.END, start)
            body = rest[start + len(self.START) : end if end >= 0 else len(rest)]
            call = _json_call(body, "arguments")
            if call is None:
                break  # not a call after all: the rest is content
            content.append(rest[:start])
            calls.append(call)
            rest = rest[end + len(self.END) :] if end >= 0 else ""
        content.append(rest)
        joined = "".join(content).strip()
        return Parsed(joined or None, calls)

    def stream(self) -> ParserStream:
        return _HermesStream(parser=self)


@dataclass
class _HermesStream(ParserStream):
    parser: HermesParser = field(default_factory=HermesParser)
    _held: str = ""
    _in_call: bool = False

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        start, end = self.parser.START, self.parser.END
        self._held += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._in_call:
                stop = self._held.find(end)
                if stop < 0:
                    break
                body, self._held = self._held[:stop], self._held[stop + len(end) :]
                call = _json_call(body, "arguments")
                if call is None:
                    content.append(start + body + end)
                else:
                    calls.append(call)
                self._in_call = False
                continue
            at = self._held.find(start)
            if at >= 0:
                content.append(self._held[:at])
                self._held, self._in_call = self._held[at + len(start) :], True
                continue
            keep = 0 if finished else held_back(self._held, start)
            content.append(self._held[: len(self._held) - keep])
            self._held = self._held[len(self._held) - keep :]
            break
        if finished and self._in_call:  # an unclosed call: whole if it parses
            call = _json_call(self._held, "arguments")
            if call is None:
                content.append(start + self._held)
            else:
                calls.append(call)
            self._held, self._in_call = "", False
        deltas = as_deltas(calls, self.num_calls) if calls else None
        self.num_calls += len(calls)
        shown = "".join(content)
        return (shown or None), deltas


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        calls = self._calls(text)
        return Parsed(None, calls) if calls else Parsed(text or None, [])

    def _calls(self, text: str) -> list[ToolCall]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return []
        calls = []
        for part in body.split("; "):
            call = _json_call(part, "parameters")
            if call is None:
                return []
            calls.append(call)
        return calls

    def stream(self) -> ParserStream:
        return _Llama3Stream(parser=self)


@dataclass
class _Llama3Stream(ParserStream):
    parser: Llama3JsonParser = field(default_factory=Llama3JsonParser)
    _held: str = ""
    _content: bool = False

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        if self._content:
            return text or None, None
        self._held += text
        lead = self._held.lstrip()
        maybe_call = lead.startswith(("{", self.parser.TAG)) or self.parser.TAG.startswith(lead)
        if not finished and (maybe_call or not lead):
            return None, None
        if finished and maybe_call:
            calls = self.parser._calls(self._held)
            if calls:
                self.num_calls = len(calls)
                return None, as_deltas(calls, 0)
        self._content = True
        held, self._held = self._held, ""
        return held or None, None


def _json_call(body: str, arguments_key: str) -> ToolCall | None:
    try:
        return call_of(msgspec.json.decode(body.strip()), arguments_key)
    except msgspec.DecodeError:
        return None


#: The parsers by their name (``--tool-call-parser``, ``Engine.chat``'s ``tool_call_parser``).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser)
}


def tool_parser(name: str | None) -> ToolParser | None:
    """The parser named ``name`` (None: none); an unknown name is a one-line
    :class:`InvalidRequestError`."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in TOOL_PARSERS:
        raise InvalidRequestError(
            f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {shown(name)}"
        )
    return TOOL_PARSERS[name]()
