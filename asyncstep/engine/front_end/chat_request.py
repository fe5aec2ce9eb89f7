"""A chat at the engine's door (``Engine.chat``'s and ``chat_stream``'s, the
HTTP API's checks too): its messages, sampling parameters and tools checked
whole, a forced call's grammar put in its parameters, its prompt rendered
through the chat template and tokenized, and how its replies are read.
Imports the door (:mod:`asyncstep.engine.front_end.input_processor`) and the
chat's parts (:mod:`asyncstep.engine.chat`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import msgspec

from asyncstep.checks import shown
from asyncstep.config import EngineConfig
from asyncstep.datatypes import SamplingParams
from asyncstep.engine.chat.chat_messages import is_chat
from asyncstep.engine.chat.chat_replies import ReplyReader
from asyncstep.engine.chat.reasoning import ReasoningParser
from asyncstep.engine.chat.tool_parsers import tool_parser
from asyncstep.engine.chat.tools import ForcedCalls, check_tools
from asyncstep.engine.front_end.input_processor import InputProcessor
from asyncstep.errors import InvalidRequestError


async def check_chat(
    door: InputProcessor,
    config: EngineConfig,
    messages: object,
    params: SamplingParams | None,
    tools: object,
    tool_choice: object,
    parallel_tool_calls: object,
    tool_call_parser: str | None,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> tuple[list[int], SamplingParams, ReplyReader]:
    """A chat checked whole at ``door`` (an engine's, ``config`` its
    config): its prompt's ids, its sampling parameters (a forced call's
    grammar in them), and how its replies are read (after the thinking, with
    ``config``'s reasoning parser). Anything wrong raises a one-line
    :class:`InvalidRequestError`, before anything is sent."""
    if not is_chat(messages):
        raise InvalidRequestError(
            f"messages must be a non-empty list of chat messages (dicts), got {shown(messages)}"
        )
    chat = cast(Sequence[Mapping[str, Any]], messages)
    checked = door.check_params(params)
    mode = check_tools(tools, tool_choice, parallel_tool_calls, chat, tool_parser(tool_call_parser))
    if isinstance(mode, ForcedCalls):
        if checked.structured_outputs is not None:
            raise InvalidRequestError(
                "a forced tool call (tool_choice required or a named function) cannot be "
                "combined with structured_outputs"
            )
        checked = msgspec.structs.replace(checked, structured_outputs=mode.structured_outputs())
    ids = await door.encode_prompt(
        chat,
        tools=cast(Sequence[Mapping[str, Any]] | None, tools),
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
    )
    return ids, checked, ReplyReader(mode, ReasoningParser.of(config))
