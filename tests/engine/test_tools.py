"""Forced tool calls (:mod:`asyncstep.engine.chat.tools`) without a server: the
schema each ``tool_choice`` forces, the output read back as calls, the
stream's deltas; and the engine's door for chat messages that carry calls."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncstep.config import REASONING_PARSERS, ModelConfig, StructuredOutputsConfig
from asyncstep.datatypes import Logprobs
from asyncstep.engine.chat.chat_replies import ReplyReader
from asyncstep.engine.chat.reasoning import ReasoningParser
from asyncstep.engine.chat.tool_parsers import (
    TOOL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    Parsed,
    ToolParser,
    make_call,
)
from asyncstep.engine.chat.tools import ForcedCalls, ToolCallStream, check_tools
from asyncstep.engine.front_end.input_processor import InputProcessor
from asyncstep.engine.messages.outputs import CompletionChunk, DeltaToolCall
from asyncstep.errors import ConfigError, InvalidRequestError
from asyncstep.models.model_info import describe_model
from asyncstep.server.config import TOOL_PARSER_NAMES, ServerConfig

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "clock"}},
]
USER: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = _deep(100)


def test_each_tool_choice_forces_its_schema() -> None:
    assert check_tools(TOOLS, "none", None, USER) is None
    assert check_tools(None, None, None, USER) is None  # no tools: none
    one = check_tools(TOOLS, named("weather"), None, USER)
    assert one is not None and one.schema() == CITY
    some = check_tools(TOOLS, "required", None, USER)
    assert some is not None
    schema = some.schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["weather", "clock"]
    single = check_tools(TOOLS, "required", False, USER)
    assert single is not None and single.schema()["maxItems"] == 1


@pytest.mark.parametrize(
    "tools,choice,messages,message",
    [
        (TOOLS, None, USER, 'tool_choice "auto" requires a tool_call_parser'),
        (TOOLS, "sometimes", USER, "tool_choice must be one of none, auto, required"),
        (None, "required", USER, "needs tools"),
        (TOOLS, named("nothing"), USER, "not among the tools"),
        ([TOOLS[0], TOOLS[0]], "required", USER, "a second tool named 'weather'"),
        (
            TOOLS,
            "required",
            [*USER, {"role": "tool", "content": "22 C", "tool_call_id": "c9"}],
            "answers no earlier tool call",
        ),
        (TOOLS, "required", [*USER, {"role": "tool", "content": "x"}], "needs tool_call_id"),
        (
            [{"type": "function", "function": {"name": "deep", "parameters": DEEP}}],
            "required",
            USER,
            "nests more than 128 levels deep",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "required",
            USER,
            "must be the schema of an object",
        ),
        ([{"type": "retrieval"}], "required", USER, "tools[0].type must be 'function'"),
        (TOOLS, "required", USER, None),  # the healthy request beside them
    ],
)
def test_bad_tools_are_refused_in_one_line(
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any] | None,
    messages: list[dict[str, Any]],
    message: str | None,
) -> None:
    if message is None:
        assert isinstance(check_tools(tools, choice, None, messages), ForcedCalls)
        return
    with pytest.raises(InvalidRequestError) as refused:
        check_tools(tools, choice, None, messages)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_outputs_read_back_as_calls() -> None:
    one = ForcedCalls({"weather": CITY}, "weather", parallel=False)
    [call] = one.calls('{"city": "Oslo"}') or []
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"
    }
    assert one.calls('{"city": "Os') is None  # cut by max_tokens
    some = ForcedCalls({"weather": CITY, "clock": {"type": "object"}}, None, parallel=True)
    calls = some.calls(
        '[{"name":"weather","parameters":{"city":"Rome"}},{"name":"clock","parameters":{}}]'
    )
    assert calls is not None and [c.function.name for c in calls] == ["weather", "clock"]
    assert len({c.id for c in calls}) == 2
    assert some.calls("[]") == [] and some.calls('{"name": "weather"}') is None


def test_a_cut_required_list_keeps_its_complete_calls() -> None:
    """A list cut by ``max_tokens`` keeps each call it completed; the cut
    one is dropped (none complete: no call, and no text as content)."""
    some = ForcedCalls({"weather": CITY, "clock": {"type": "object"}}, None, parallel=True)
    calls = some.calls(LISTED[: LISTED.index('{"name": "clock"') + 9])
    assert calls is not None and [c.function.name for c in calls] == ["weather", "weather"]
    assert [json.loads(c.function.arguments) for c in calls] == [
        {"city": 'Rome, "Lazio" {1}'},
        {"city": "Oslo"},
    ]
    assert some.calls('[{"name": "weather", "parameters": {"ci') == []


def test_a_named_call_streams_its_name_then_its_arguments() -> None:
    stream = ToolCallStream(ForcedCalls({"weather": CITY}, "weather", parallel=False))
    first, content = stream.delta('{"ci', finished=False)
    assert content is None and first is not None
    assert first[0].id and first[0].function is not None
    assert (first[0].function.name, first[0].function.arguments) == ("weather", '{"ci')
    second, _ = stream.delta('ty": "Oslo"}', finished=True)
    assert second is not None and second[0].id is None and second[0].function is not None
    assert second[0].function.arguments == 'ty": "Oslo"}'
    assert stream.delta("", finished=True) == (None, None)


#: A ``required`` list of three calls (braces, brackets, commas and escaped
#: quotes inside a string), as a reply cut by ``max_tokens`` in the third.
LISTED = (
    '[{"name": "weather", "parameters": {"city": "Rome, \\"Lazio\\" {1}"}}, '
    '{"name": "weather", "parameters": {"city": "Oslo"}}, '
    '{"name": "clock", "parameters": {}}]'
)


@given(cuts=st.lists(st.integers(min_value=0, max_value=len(LISTED)), max_size=12))
def test_required_calls_stream_each_as_soon_as_it_is_complete(cuts: list[int]) -> None:
    """Each call of a ``required`` list comes as one delta (id, name, its
    whole arguments) with the piece that completes it, wherever the text
    is cut; never as content; the call ``max_tokens`` cut is dropped."""
    forced = ForcedCalls({"weather": CITY, "clock": {"type": "object"}}, None, parallel=True)
    ends = [LISTED.index("}}, ") + 2, LISTED.rindex("}}, ") + 2, len(LISTED) - 1]
    for text in (LISTED, LISTED[: ends[2] - 1]):  # whole, and cut in the third call
        points = sorted({0, *(c for c in cuts if c < len(text)), len(text)})
        stream = ToolCallStream(forced)
        seen: list[tuple[int, DeltaToolCall]] = []
        for a, b in itertools.pairwise(points):
            deltas, content = stream.delta(text[a:b], finished=b == len(text))
            assert content is None
            assert all(ends[d.index] in range(a + 1, b + 1) for d in deltas or [])
            seen += [(b, d) for d in deltas or []]
        whole = forced.calls(text) or []
        assert [d.index for _, d in seen] == list(range(len(whole)))
        for (_, delta), call in zip(seen, whole, strict=True):
            assert delta.id and delta.type == "function" and delta.function is not None
            assert delta.function.name == call.function.name
            assert delta.function.arguments == call.function.arguments
        assert stream.num_calls == len(whole) == (3 if text == LISTED else 2)


def test_a_reply_stream_leaves_out_empty_pieces_their_tokens_go_with_the_next() -> None:
    """No piece without text, thinking, call deltas or a finish reason:
    the tokens (and log-probs) of those left out come with the next piece."""
    stream = ReplyReader(ForcedCalls({"weather": CITY}, None, parallel=True)).stream()
    pieces = ['[{"name": "weather", ', '"parameters": {"city": ', '"Oslo"}}', ", {", ""]
    taken = []
    for i, text in enumerate(pieces):
        chunk = CompletionChunk(
            "r",
            text,
            [i],
            finish_reason="length" if i == len(pieces) - 1 else None,
            logprobs=[Logprobs([i], [-0.5], 1)],
        )
        taken.append(stream.take(chunk))
    assert taken[0] is None and taken[1] is None and taken[3] is None
    [call, end] = [piece for piece in taken if piece is not None]
    assert call.calls is not None and call.calls[0].function is not None
    assert call.calls[0].function.name == "weather" and call.finish_reason is None
    assert call.token_ids == [0, 1, 2] and call.logprobs is not None
    assert [entry.token_ids for entry in call.logprobs] == [[0], [1], [2]]
    assert end.token_ids == [3, 4] and not end.calls and end.content is None
    assert end.finish_reason == "length"  # cut: not "tool_calls", though one call was made
    kept = ReplyReader().stream().take(CompletionChunk("r", "", [7]), keep_empty=True)
    assert kept is not None and kept.token_ids == [7]  # (a stream's first chunk: its role)


@pytest.fixture(scope="module")
def door() -> InputProcessor:
    """The embedded model's door (its tokenizer and chat template)."""
    info = describe_model(ModelConfig())
    return InputProcessor(info.arch_config, info.tokenizer, 1024)


CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages,tools,message",
    [
        ([{"role": "assistant", "tool_calls": "x"}], None, "'tool_calls' must be a non-empty list"),
        ([{"role": "assistant", "tool_calls": [{"id": "c1"}]}], None, "a 'function' object"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": 3, "arguments": "{}"}}]}],
            None,
            "'tool_calls[].function.name' must be a string",
        ),
        ([{"role": "assistant", "content": None}], None, "'content' must be a string"),
        ([{"role": "tool", "content": "x", "tool_call_id": 7}], None, "'tool_call_id' must be"),
        ([{"role": "user", "content": "x"}], [{"f": object()}], "tools must be JSON"),
    ],
)
def test_the_door_checks_calls_in_chat_messages(
    door: InputProcessor,
    messages: list[dict[str, object]],
    tools: list[dict[str, object]] | None,
    message: str,
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        door.encode_prompt_nowait(messages, tools=tools)
    assert message in str(refused.value)


def test_tools_go_with_chat_messages_only(door: InputProcessor) -> None:
    with pytest.raises(InvalidRequestError, match="tools go with chat messages only"):
        door.encode_prompt_nowait("hi", tools=[{"type": "function"}])


def test_a_tool_loop_s_history_renders_through_the_template(door: InputProcessor) -> None:
    """An assistant's call (content null) and the tool's answer are taken;
    the answer reaches the prompt."""
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C and sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": CITY}}]
    ids = door.encode_prompt_nowait(history, tools=tools)
    assert door.tokenizer is not None and "22 C and sunny" in door.tokenizer.decode(ids)


# -- auto: the parsers ---------------------------------------------------------

HERMES = (
    'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    '<tool_call>{"name": "clock", "arguments": {}}</tool_call>'
)
LLAMA3 = '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "clock"}'


def streamed(parser: ToolParser, pieces: list[str]) -> Parsed:
    stream = parser.stream()
    content: list[str] = []
    calls: list[tuple[int, str, str]] = []
    for i, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, finished=i == len(pieces) - 1)
        content.append(text or "")
        for delta in deltas or []:
            assert delta.id and delta.function is not None and delta.function.name
            calls.append((delta.index, delta.function.name, delta.function.arguments or ""))
    assert [index for index, _, _ in calls] == list(range(len(calls)))
    made = [make_call(name, arguments) for _, name, arguments in calls]
    return Parsed("".join(content).strip() or None, made)


def summary(parsed: Parsed) -> tuple[str | None, list[tuple[str, object]]]:
    return parsed.content, [
        (c.function.name, json.loads(c.function.arguments)) for c in parsed.calls
    ]


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        (HermesParser(), HERMES, "Let me look.", [("weather", {"city": "Oslo"}), ("clock", {})]),
        (HermesParser(), "No call here.", "No call here.", []),
        (HermesParser(), "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        (HermesParser(), '<tool_call>{"name": "clock"', '<tool_call>{"name": "clock"', []),
        (Llama3JsonParser(), LLAMA3, None, [("weather", {"city": "Oslo"}), ("clock", {})]),
        (Llama3JsonParser(), '{"name": "clock", "parameters": {}}', None, [("clock", {})]),
        (Llama3JsonParser(), "Hello there.", "Hello there.", []),
        (Llama3JsonParser(), '{"not": "a call"}', '{"not": "a call"}', []),
    ],
)
def test_a_parser_reads_calls_whole_and_in_any_pieces(
    parser: ToolParser, text: str, content: str | None, calls: list[tuple[str, object]]
) -> None:
    assert summary(parser.parse(text)) == (content, calls)
    for size in (1, 2, 3, 7, len(text)):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert summary(streamed(parser, pieces)) == (content, calls), size


@given(cuts=st.lists(st.integers(min_value=0, max_value=len(HERMES)), max_size=12))
def test_hermes_streams_the_same_wherever_the_text_is_cut(cuts: list[int]) -> None:
    points = sorted({0, *cuts, len(HERMES)})
    pieces = [HERMES[a:b] for a, b in itertools.pairwise(points)] or [""]
    assert summary(streamed(HermesParser(), pieces)) == summary(HermesParser().parse(HERMES))


def test_the_parsers_are_the_server_options() -> None:
    assert set(TOOL_PARSERS) == set(TOOL_PARSER_NAMES)
    with pytest.raises(ConfigError, match="tool_call_parser must be one of hermes, llama3_json"):
        ServerConfig(tool_call_parser="xml")
    with pytest.raises(ConfigError, match="enable_auto_tool_choice needs a tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    parser = HermesParser()
    assert check_tools(TOOLS, "auto", None, USER, parser) is parser
    assert check_tools(TOOLS, None, None, USER, parser) is parser


# -- reasoning -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name,text,reasoning,content",
    [
        ("qwen3", "<think>\nhot\n</think>\n\nSunny.", "hot", "Sunny."),
        ("qwen3", "Sunny.", None, "Sunny."),  # thinking switched off
        ("qwen3", "<think>cut sho", "cut sho", None),
        ("deepseek_r1", "hot</think>Sunny.", "hot", "Sunny."),
        ("deepseek_r1", "<think>hot</think>Sunny.", "hot", "Sunny."),
        ("deepseek_r1", "still thinking", "still thinking", None),
    ],
)
def test_thinking_is_read_apart_whole_and_in_any_pieces(
    name: str, text: str, reasoning: str | None, content: str | None
) -> None:
    parser = ReasoningParser.named(name)
    assert parser.split(text) == (reasoning, content)
    for size in (1, 2, 5, len(text)):
        stream = parser.stream()
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        got = [stream.feed(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        thought = "".join(r or "" for r, _ in got).strip() or None
        said = "".join(c or "" for _, c in got).strip() or None
        assert (thought, said) == (reasoning, content), size


def test_the_reasoning_parsers_are_the_server_options() -> None:
    assert {ReasoningParser.named(n).name for n in REASONING_PARSERS} == {"qwen3", "deepseek_r1"}
    with pytest.raises(ConfigError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        StructuredOutputsConfig(reasoning_parser="o1")
