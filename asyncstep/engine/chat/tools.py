"""Tool calling (OpenAI's ``tools`` and ``tool_choice``) at the engine's
door, and the calls a grammar forces; used by ``Engine.chat`` and by the
HTTP server's ``/v1/chat/completions`` alike.

* At the door (:func:`check_tools`, on plain JSON values): at most
  :data:`MAX_TOOLS` function tools, each named ``[A-Za-z0-9_-]{1,64}``,
  names unique, ``parameters`` the JSON schema of an object of at most
  :data:`~asyncstep.structured_params.MAX_GRAMMAR_CHARS` characters nested
  at most :data:`~asyncstep.checks.MAX_JSON_DEPTH` deep (forced, the
  grammar's budget bounds it further, as any ``json`` schema's);
  ``tool_choice`` ``none``, ``auto``, ``required`` or a named function that
  is among the tools; every ``tool`` message answers a call of an earlier
  assistant message (``tool_call_id``), call ids unique. ``auto`` (the
  model chooses, a :mod:`~asyncstep.engine.chat.tool_parsers` parser reads its
  calls) needs a parser: refused without one. Each refusal is a one-line
  :class:`~asyncstep.errors.InvalidRequestError` that starts with the
  field at fault.
* ``required`` and a named function are **forced** (:class:`ForcedCalls`):
  the output follows a JSON schema, so every call parses and validates
  against its tool's parameters whatever the model's size (vLLM's shapes: a
  named function's output is its arguments; ``required``'s a list of
  ``{"name": ..., "parameters": ...}``, one item without
  ``parallel_tool_calls``).
* The output becomes calls (:meth:`ForcedCalls.calls`), finish reason
  ``tool_calls``; streamed (:class:`ToolCallStream`), a named call's id and
  name come first, then its arguments as they are generated; each call of
  a ``required`` list as one delta (id, name, whole arguments) as soon as
  it is complete (:class:`ListItems` finds each item's end). A list cut by
  ``max_tokens`` keeps the calls it completed (finish reason ``length``);
  the cut one is dropped, never shown as content.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncstep.checks import check_json_depth, shown
from asyncstep.engine.chat.tool_parsers import (
    ToolParser,
    as_deltas,
    call_of,
    make_call,
    new_call_id,
)
from asyncstep.engine.messages.outputs import DeltaFunctionCall, DeltaToolCall, ToolCall
from asyncstep.errors import InvalidRequestError
from asyncstep.structured_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams

#: Most tools one request may list.
MAX_TOOLS = 128
#: A tool's name (OpenAI's rule).
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: ``tool_choice`` strings.
TOOL_CHOICES = ("none", "auto", "required")
#: The schema of a tool without ``parameters``: any object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ForcedCalls:
    """The calls a grammar forces: one call of ``name`` (its arguments are
    the whole output), or (``name`` None, ``required``) a list of calls of
    any of ``tools``, at most one without ``parallel``."""

    tools: dict[str, dict[str, Any]]  # name -> parameters schema
    name: str | None
    parallel: bool

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output follows."""
        if self.name is not None:
            return self.tools[self.name]
        one_of = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in self.tools.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def structured_outputs(self) -> StructuredOutputsParams:
        """The grammar of :meth:`schema` (compact JSON: no whitespace, the
        fewest tokens a call can take)."""
        return StructuredOutputsParams(json=self.schema(), disable_any_whitespace=True)

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls of a whole output. A named call: None when it does not
        parse (cut by ``max_tokens``: the text stays the message's content).
        A ``required`` list: each call it completed (a list cut short keeps
        those before the cut), or None when the text is not a list."""
        if self.name is not None:
            try:
                msgspec.json.decode(text)
            except msgspec.DecodeError:
                return None
            return [make_call(self.name, text.strip())]
        items = ListItems()
        done = items.feed(text)
        return self.listed(done) if items.opened else None

    def listed(self, items: list[str]) -> list[ToolCall]:
        """The calls of a ``required`` list's complete items (up to the first
        that is not a call: none is, under the grammar)."""
        calls = []
        for item in items:
            call = call_of(_decoded(item), "parameters")
            if call is None:
                break
            calls.append(call)
        return calls


#: How a chat's output is read as calls: forced, by ``auto``'s parser, or not at all.
ToolMode = ForcedCalls | ToolParser | None


def check_tools(
    tools: object,
    tool_choice: object,
    parallel_tool_calls: object,
    messages: Sequence[Mapping[str, Any]],
    parser: ToolParser | None = None,
    *,
    auto_needs: str = "a tool_call_parser",
) -> ToolMode:
    """The request's tools checked (see the module doc): the calls to
    force, or (``auto``) the ``parser`` that reads the model's calls (none:
    ``auto`` is refused, the message saying it needs ``auto_needs``), or
    None. ``tools`` and ``tool_choice`` are JSON values (OpenAI's shapes)."""
    by_name = _tools_by_name(tools)
    _check_tool_messages(messages)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError(
            f"parallel_tool_calls must be a bool or None, got {shown(parallel_tool_calls)}"
        )
    if tool_choice is None:
        tool_choice = "auto" if by_name else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InvalidRequestError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                f"got {shown(tool_choice)}"
            )
        if tool_choice == "none":
            return None
        if not by_name:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools")
        if tool_choice == "auto" and parser is not None:
            return parser
        if tool_choice == "auto":
            raise InvalidRequestError(
                f'tool_choice "auto" requires {auto_needs} (or use "required" or a named '
                "function, whose calls a grammar forces)"
            )
        return ForcedCalls(by_name, None, parallel_tool_calls is not False)
    name = _named_choice(tool_choice)
    if name not in by_name:
        raise InvalidRequestError(f"tool_choice names {shown(name)}, which is not among the tools")
    return ForcedCalls(by_name, name, parallel=False)


def _named_choice(choice: object) -> str:
    """The function a ``{"type": "function", "function": {"name": ...}}`` names."""
    if not isinstance(choice, Mapping):
        raise InvalidRequestError(
            f"tool_choice must be a string or a named function, got {shown(choice)}"
        )
    if choice.get("type") != "function":
        raise InvalidRequestError(f"tool_choice.type must be 'function', got {shown(choice)}")
    function = choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError(f"tool_choice.function.name must be a string, got {shown(name)}")
    return name


def _tools_by_name(tools: object) -> dict[str, dict[str, Any]]:
    if tools is None:
        return {}
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise InvalidRequestError(f"tools must be a list of function tools, got {shown(tools)}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools holds {len(tools)} tools, more than {MAX_TOOLS}")
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise InvalidRequestError(f"tools[{i}].type must be 'function', got {shown(kind)}")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise InvalidRequestError(f"tools[{i}].function must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(
                f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}, got {shown(name)}"
            )
        if name in by_name:
            raise InvalidRequestError(f"tools[{i}]: a second tool named {name!r}")
        by_name[name] = _parameters(i, function.get("parameters"))
    return by_name


def _parameters(index: int, parameters: object) -> dict[str, Any]:
    """A tool's ``parameters``: the JSON schema of an object, bounded in
    size and nesting before anything parses it further."""
    if parameters is None:
        return ANY_OBJECT
    what = f"tools[{index}].function.parameters"
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(
            f"{what} must be the schema of an object, got {shown(parameters)}"
        )
    try:
        text = msgspec.json.encode(parameters)
    except (TypeError, msgspec.EncodeError, UnicodeEncodeError, RecursionError) as exc:
        raise InvalidRequestError(f"{what} must be JSON: {exc}") from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{what} is longer than {MAX_GRAMMAR_CHARS} bytes")
    check_json_depth(what, text)
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"{what} must be the schema of an object")
    decoded: dict[str, Any] = msgspec.json.decode(text)
    return decoded


def _check_tool_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Each ``tool`` message names, in ``tool_call_id``, a call of an
    earlier assistant message; call ids are unique."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or []:
            call_id = call.get("id") if isinstance(call, Mapping) else None
            if call_id is None:
                continue
            if call_id in calls:
                raise InvalidRequestError(f"messages[{i}]: a second tool call id {call_id!r}")
            calls.add(call_id)
        if message.get("role") == "tool":
            answered = message.get("tool_call_id")
            if answered is None:
                raise InvalidRequestError(f"messages[{i}]: a tool message needs tool_call_id")
            if answered not in calls:
                raise InvalidRequestError(
                    f"messages[{i}].tool_call_id {shown(answered)} answers no earlier tool call"
                )


def _decoded(text: str) -> object:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None


@dataclass
class ListItems:
    """The items of a JSON list whose text comes in pieces: :meth:`feed`
    gives the text of each object item once it is complete (strings,
    escapes and nesting followed; a forced list's items are objects)."""

    #: Whether the list opened (its ``[`` seen; text before it is not a list).
    opened: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _item: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[str]:
        """The items ``text`` completes."""
        done: list[str] = []
        for char in text:
            if self._depth > 1:  # inside an item
                self._item.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                self._open(char)
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and char == "}":
                    done.append("".join(self._item))
                    self._item.clear()
        return done

    def _open(self, char: str) -> None:
        if self._depth == 0:
            self.opened = self.opened or char == "["
        elif self._depth == 1:
            self._item.append(char)  # an item starts
        self._depth += 1


@dataclass
class ToolCallStream:
    """One choice's forced calls as stream deltas (see the module doc)."""

    forced: ForcedCalls
    #: Calls whose first delta went out.
    num_calls: int = 0
    _items: ListItems = field(default_factory=ListItems)
    #: An item that was not a call ended the list (never, under the grammar).
    _ended: bool = False
    _call_id: str | None = None

    def delta(self, text: str, finished: bool) -> tuple[list[DeltaToolCall] | None, str | None]:
        """The tool-call deltas for the next piece of output, and the text
        to show as content instead (none: a forced reply is calls alone)."""
        if self.forced.name is not None:
            return self._named(text), None
        items = [] if self._ended else self._items.feed(text)
        calls = self.forced.listed(items)
        self._ended = len(calls) < len(items)  # as the whole reply is read
        deltas = as_deltas(calls, self.num_calls) if calls else None
        self.num_calls += len(calls)
        return deltas, None

    def _named(self, text: str) -> list[DeltaToolCall] | None:
        """The named call's id and name with its first piece, then its
        arguments piece by piece."""
        if self._call_id is None:
            self._call_id = new_call_id()
            self.num_calls = 1
            function = DeltaFunctionCall(name=self.forced.name, arguments=text)
            return [DeltaToolCall(0, id=self._call_id, type="function", function=function)]
        if not text:
            return None
        return [DeltaToolCall(0, function=DeltaFunctionCall(arguments=text))]
