"""Tool calling on ``/v1/chat/completions`` (OpenAI's ``tools`` and
``tool_choice``), the calls a grammar forces.

* At the door (:func:`check_tools`): at most :data:`MAX_TOOLS` function
  tools, each named ``[A-Za-z0-9_-]{1,64}``, names unique, ``parameters`` a
  JSON object (the grammar's budget bounds it, as any ``json_schema``);
  ``tool_choice`` ``none``, ``auto``, ``required`` or a named function that
  is among the tools; every ``tool`` message answers a call of an earlier
  assistant message (``tool_call_id``). ``auto`` (the model chooses, a
  :mod:`~asyncstep.server.tool_parsers` parser reads its calls) needs
  ``--enable-auto-tool-choice`` and ``--tool-call-parser``, as vLLM's.
* ``required`` and a named function are **forced** (:class:`ForcedCalls`):
  the output follows a JSON schema, so every call parses and validates
  against its tool's parameters whatever the model's size (vLLM's shapes: a
  named function's output is its arguments; ``required``'s a list of
  ``{"name": ..., "parameters": ...}``, one item without
  ``parallel_tool_calls``).
* The output becomes ``message.tool_calls`` (:meth:`ForcedCalls.calls`),
  ``finish_reason`` ``tool_calls``; streamed (:class:`ToolCallStream`), a
  named call's id and name come first, then its arguments as they are
  generated; ``required``'s calls when the list is complete.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncstep.checks import shown
from asyncstep.server.errors import bad_request
from asyncstep.server.protocol import (
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
)
from asyncstep.server.tool_parsers import ToolParser, as_deltas, make_call, new_call_id

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

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls of a whole output, or None when it does not parse (cut
        by ``max_tokens``: the text stays the message's content)."""
        if self.name is not None:
            try:
                msgspec.json.decode(text)
            except msgspec.DecodeError:
                return None
            return [make_call(self.name, text)]
        try:
            items = msgspec.json.decode(text)
        except msgspec.DecodeError:
            return None
        if not isinstance(items, list):
            return None
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = msgspec.json.encode(item.get("parameters", {})).decode()
            calls.append(make_call(item["name"], arguments))
        return calls


def check_tools(
    tools: Sequence[ChatTool] | None,
    tool_choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    messages: Sequence[ChatMessage],
    parser: ToolParser | None = None,
) -> ForcedCalls | ToolParser | None:
    """The request's tools checked (see the module doc): the calls to force,
    or (``auto``) the ``parser`` that reads the model's calls (none: ``auto``
    is refused), or None. A bad value is a 400 naming its field."""
    by_name = _tools_by_name(tools or [])
    _check_tool_messages(messages)
    if tool_choice is None:
        tool_choice = "auto" if by_name else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise bad_request(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                f"got {shown(tool_choice)}",
                "tool_choice",
            )
        if tool_choice == "none":
            return None
        if not by_name:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        if tool_choice == "auto" and parser is not None:
            return parser
        if tool_choice == "auto":
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                'to be set (or use "required" or a named function, whose calls a grammar '
                "forces)",
                "tool_choice",
            )
        return ForcedCalls(by_name, None, parallel_tool_calls is not False)
    if tool_choice.type != "function":
        raise bad_request(f"tool_choice.type must be 'function', got {shown(tool_choice.type)}")
    name = tool_choice.function.name
    if name not in by_name:
        raise bad_request(f"tool_choice names {shown(name)}, which is not among the tools")
    return ForcedCalls(by_name, name, parallel=False)


def template_tools(tools: Sequence[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape, as builtins)."""
    if not tools:
        return None
    return [msgspec.to_builtins(tool) for tool in tools]


def _tools_by_name(tools: Sequence[ChatTool]) -> dict[str, dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools holds {len(tools)} tools, more than {MAX_TOOLS}", "tools")
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            kind = shown(tool.type)
            raise bad_request(f"tools[{i}].type must be 'function', got {kind}", "tools")
        name = tool.function.name
        if not TOOL_NAME.fullmatch(name):
            raise bad_request(
                f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}, got {shown(name)}",
                "tools",
            )
        if name in by_name:
            raise bad_request(f"tools[{i}]: a second tool named {name!r}", "tools")
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise bad_request(
                f"tools[{i}].function.parameters must be the schema of an object", "tools"
            )
        by_name[name] = ANY_OBJECT if parameters is None else parameters
    return by_name


def _check_tool_messages(messages: Sequence[ChatMessage]) -> None:
    """Each ``tool`` message names, in ``tool_call_id``, a call of an
    earlier assistant message; call ids are unique."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        for call in message.tool_calls or []:
            if call.id in calls:
                raise bad_request(f"messages[{i}]: a second tool call id {call.id!r}", "messages")
            calls.add(call.id)
        if message.role == "tool":
            if message.tool_call_id is None:
                raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", "messages")
            if message.tool_call_id not in calls:
                raise bad_request(
                    f"messages[{i}].tool_call_id {shown(message.tool_call_id)} answers no "
                    "earlier tool call",
                    "messages",
                )


@dataclass
class ToolCallStream:
    """One choice's forced calls as stream deltas (see the module doc)."""

    forced: ForcedCalls
    _text: list[str] = field(default_factory=list)
    _call_id: str | None = None

    def delta(self, text: str, finished: bool) -> tuple[list[DeltaToolCall] | None, str | None]:
        """The tool-call deltas for the next piece of output, and the text
        to show as content instead (a ``required`` list that did not parse)."""
        self._text.append(text)
        if self.forced.name is not None:
            if self._call_id is None:
                self._call_id = new_call_id()
                function = DeltaFunctionCall(name=self.forced.name, arguments=text)
                first = DeltaToolCall(0, id=self._call_id, type="function", function=function)
                return [first], None
            if not text:
                return None, None
            return [DeltaToolCall(0, function=DeltaFunctionCall(arguments=text))], None
        if not finished:
            return None, None
        whole = "".join(self._text)
        calls = self.forced.calls(whole)
        if calls is None:
            return None, whole
        return as_deltas(calls, 0), None
