"""The Python API's chats (``Engine.chat``, ``Engine.chat_stream``) under
Trio and asyncio: forced calls (``required``, a named function) that parse
and validate, whole and streamed as OpenAI's deltas; ``auto`` read by the
hermes parser; a tool loop to its answer; a request's own chat template and
its variables; and the door: each bad input a one-line
``InvalidRequestError`` that leaves the engine serving. Over HTTP, a
request's chat template is refused unless the server trusts them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import httpx
import jsonschema
import pytest

import asyncstep
from asyncstep import SamplingParams, StructuredOutputsParams
from asyncstep.engine.chat.chat_messages import (
    MAX_CHAT_TEMPLATE_KWARGS_BYTES,
    MAX_REQUEST_CHAT_TEMPLATE_BYTES,
)
from asyncstep.engine.chat.tools import MAX_TOOLS
from asyncstep.engine.messages.outputs import ChatChunk, ChatCompletion
from asyncstep.errors import InvalidRequestError
from asyncstep.models.model_loader import LoadedModel
from asyncstep.server import ServerConfig, build_app

pytestmark = pytest.mark.anyio

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 20}},
    "required": ["zone"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=80)


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_forced_calls_parse_and_validate_whole_and_streamed(
    smollm2: LoadedModel, anyio_backend: str
) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        whole: list[ChatCompletion] = []
        chunks: list[ChatChunk] = []
        sampled: dict[int, ChatCompletion] = {}

        async def named_whole() -> None:
            whole.append(
                await engine.chat(
                    ASK, GREEDY, tools=[WEATHER, TIME], tool_choice=named_choice("get_weather")
                )
            )

        async def named_streamed() -> None:
            async for c in engine.chat_stream(
                ASK, GREEDY, tools=[WEATHER, TIME], tool_choice=named_choice("get_weather")
            ):
                chunks.append(c)

        async def sample(seed: int) -> None:
            sampled[seed] = await engine.chat(
                ASK,
                SamplingParams(temperature=1.0, seed=seed, max_tokens=100),
                tools=[WEATHER, TIME],
                tool_choice="required",
                parallel_tool_calls=seed % 2 == 0,
            )

        assert engine.tokenizer is not None
        endless = SamplingParams(
            temperature=0, max_tokens=100, logit_bias=never_closed(engine.tokenizer)
        )
        cut: dict[bool | None, ChatCompletion] = {}
        cut_chunks: list[ChatChunk] = []

        async def endless_whole(parallel: bool | None) -> None:
            cut[parallel] = await engine.chat(
                ASK,
                endless,
                tools=[WEATHER, TIME],
                tool_choice="required",
                parallel_tool_calls=parallel,
            )

        async def endless_streamed() -> None:
            async for c in engine.chat_stream(
                ASK, endless, tools=[WEATHER, TIME], tool_choice="required"
            ):
                cut_chunks.append(c)

        # One batch: the named call whole and streamed, the endless list whole
        # and streamed (dense fp32: their greedy tokens are the same in any
        # batch), the endless list with one call allowed, and the sampled ones.
        async with anyio.create_task_group() as tg:
            tg.start_soon(named_whole)
            tg.start_soon(named_streamed)
            tg.start_soon(endless_whole, None)
            tg.start_soon(endless_whole, False)
            tg.start_soon(endless_streamed)
            for seed in range(6):
                tg.start_soon(sample, seed)
    [named] = whole
    assert named.finish_reason == "tool_calls" and named.content is None
    [call] = named.tool_calls
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)

    deltas = [d for c in chunks for d in c.tool_calls or []]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.index == 0 for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas if d.function) == (
        call.function.arguments
    )
    assert chunks[-1].finish_reason == "tool_calls" and not any(c.content for c in chunks)
    assert sum(len(c.token_ids) for c in chunks) == len(named.outputs[0].token_ids)

    judged = {s: out for s, out in sampled.items() if out.outputs[0].finish_reason != "length"}
    assert len(judged) >= 4
    for seed, out in judged.items():
        assert out.finish_reason == "tool_calls" and out.tool_calls
        assert len(out.tool_calls) == 1 or seed % 2 == 0  # parallel only when allowed
        for made in out.tool_calls:
            jsonschema.validate(json.loads(made.function.arguments), SCHEMAS[made.function.name])
    check_cut_list(cut[None], cut_chunks)
    [single] = cut[False].tool_calls  # the grammar allows one call: the list closes after it
    assert cut[False].finish_reason == "tool_calls"
    assert single.function.arguments == cut[None].tool_calls[0].function.arguments


def never_closed(tokenizer: Any) -> dict[int, float]:
    """A ``logit_bias`` against every token that holds a ``]``: a
    ``required`` list then never closes and calls follow calls until
    ``max_tokens`` cuts the reply (what a small model does by itself at
    times), while a list of one call (``parallel_tool_calls`` false) must
    still close (the grammar allows nothing else)."""
    return {i: -100.0 for token, i in tokenizer.get_vocab().items() if "]" in token}


def complete_calls(text: str) -> list[tuple[str, Any]]:
    """The (name, parameters) of each call a cut ``required`` list
    completed: its longest prefix that is a list once closed."""
    ends = [i + 1 for i, char in enumerate(text) if char == "}"]
    for end in reversed(ends):
        try:
            items = json.loads(text[:end] + "]")
        except ValueError:
            continue
        return [(item["name"], item["parameters"]) for item in items]
    return []


def check_cut_list(whole: ChatCompletion, chunks: list[ChatChunk]) -> None:
    """A ``required`` list cut by ``max_tokens``: whole, the calls it
    completed (the cut one dropped) and no content, finish reason
    ``length``; streamed, the same calls, each as soon as it is complete,
    and no chunk without something new."""
    assert whole.finish_reason == "length" and whole.content is None
    made = [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]
    assert len(made) >= 2 and made == complete_calls(whole.outputs[0].text)
    assert not whole.outputs[0].text.endswith("}")  # the cut call was there, and dropped
    for name, arguments in made:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(c.content or c.reasoning_content or c.tool_calls or c.finish_reason for c in chunks)
    assert not any(c.content for c in chunks) and chunks[-1].finish_reason == "length"
    deltas = [d for c in chunks for d in c.tool_calls or []]
    assert [d.index for d in deltas] == list(range(len(made)))
    assert all(d.id and d.function and d.function.name for d in deltas)
    assert [
        (d.function.name, json.loads(d.function.arguments or "")) for d in deltas if d.function
    ] == made
    first = next(i for i, c in enumerate(chunks) if c.tool_calls)
    assert first < len(chunks) - 1  # as soon as it was complete, not at the end
    assert sum(len(c.token_ids) for c in chunks) == len(whole.outputs[0].token_ids)


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_auto_calls_are_read_by_the_parser_and_a_loop_runs_to_its_answer(
    smollm2: LoadedModel, anyio_backend: str
) -> None:
    """``auto`` with ``tool_call_parser="hermes"``: a reply that writes a call
    (made so by a regex: a small model rarely does) is the call; then the
    tool's result goes back in the history and the model answers."""
    arguments = {"city": "Rome", "unit": "celsius"}
    reply = (
        f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}</tool_call>'
    )
    writes_a_call = SamplingParams(
        temperature=0,
        max_tokens=200,
        structured_outputs=StructuredOutputsParams(regex=re.escape(reply)),
    )
    async with asyncstep.open_engine(smollm2) as engine:
        whole: list[ChatCompletion] = []
        streamed: list[ChatChunk] = []

        async def auto_whole() -> None:
            whole.append(
                await engine.chat(ASK, writes_a_call, tools=[WEATHER], tool_call_parser="hermes")
            )

        async def auto_streamed() -> None:
            async for c in engine.chat_stream(
                ASK, writes_a_call, tools=[WEATHER], tool_call_parser="hermes"
            ):
                streamed.append(c)

        async with anyio.create_task_group() as tg:  # whole and streamed in one batch
            tg.start_soon(auto_whole)
            tg.start_soon(auto_streamed)
        [auto] = whole
        [call] = auto.tool_calls
        history: list[dict[str, Any]] = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [msgspec_call(call)]},
            {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"},
        ]
        short = SamplingParams(temperature=0, max_tokens=16)
        answer = await engine.chat(history, short, tools=[WEATHER], tool_choice="none")
    assert auto.finish_reason == "tool_calls" and auto.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == arguments
    deltas = [d for c in streamed for d in c.tool_calls or []]
    assert [d.function.name for d in deltas if d.function] == ["get_weather"]
    assert streamed[-1].finish_reason == "tool_calls"
    assert answer.finish_reason in ("stop", "length") and not answer.tool_calls
    assert answer.content


def named_choice(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def msgspec_call(call: Any) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


async def test_a_request_s_chat_template_and_its_variables(
    smollm2: LoadedModel, anyio_backend: str
) -> None:
    template = (
        "{% if shout %}LOUD {% endif %}{{ greeting }}: "
        "{% for m in messages %}{{ m['content'] }}{% endfor %}\n"
    )
    async with asyncstep.open_engine(smollm2) as engine:
        assert engine.tokenizer is not None
        ids = await engine.encode_prompt(
            ASK, chat_template=template, chat_template_kwargs={"greeting": "Hi", "shout": True}
        )
        assert engine.tokenizer.decode(ids) == f"LOUD Hi: {ASK[0]['content']}"
        own = engine.tokenizer.decode(await engine.encode_prompt(ASK))
        assert own.startswith("<|im_start|>")  # the tokenizer's own template otherwise
        out = await engine.chat(
            ASK, SamplingParams(temperature=0, max_tokens=4), chat_template=template
        )
        assert out.outputs[0].token_ids and out.finish_reason in ("stop", "length")


#: (what, chat's keywords, the one-line error's start).
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("messages not a chat", {"messages": "hi"}, "messages must be a non-empty list"),
    ("two tools of one name", {"tools": [WEATHER, WEATHER]}, "tools[1]: a second tool named"),
    ("a bad tool name", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]"),
    ("too many tools", {"tools": [WEATHER] * (MAX_TOOLS + 1)}, "tools holds 129 tools"),
    (
        "a schema nested too deep",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": "deep"}}]},
        "tools[0].function.parameters nests more than 128 levels deep",
    ),
    (
        "a schema too large for the grammar's budget",
        {"tools": "wide", "tool_choice": "required"},
        "structured_outputs.json",
    ),
    ("an unknown named function", {"tool_choice": named_choice("nope")}, "tool_choice names"),
    ("auto without a parser", {"tool_choice": "auto"}, 'tool_choice "auto" requires'),
    ("a bad parser name", {"tool_call_parser": "xml"}, "tool_call_parser must be one of"),
    ("a bad tool_choice", {"tool_choice": "sometimes"}, "tool_choice must be one of"),
    (
        "a tool message that answers no call",
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "c9", "content": "x"}]},
        "messages[1].tool_call_id 'c9' answers no earlier tool call",
    ),
    (
        "forced and structured outputs",
        {"tool_choice": "required", "structured": True},
        "a forced tool call",
    ),
    ("a template not text", {"chat_template": 3}, "chat_template must be a string"),
    (
        "a template too large",
        {"chat_template": "x" * (MAX_REQUEST_CHAT_TEMPLATE_BYTES + 1)},
        "chat_template has",
    ),
    (
        "a template escaping its sandbox",
        {"chat_template": "{{ messages.append(1) }}"},
        "chat template failed",
    ),
    ("variables not an object", {"chat_template_kwargs": [1]}, "chat_template_kwargs must be"),
    (
        "a reserved variable",
        {"chat_template_kwargs": {"messages": []}},
        "chat_template_kwargs may not set 'messages'",
    ),
    (
        "a special token as a variable",
        {"chat_template_kwargs": {"eos_token": "x"}},
        "chat_template_kwargs may not set 'eos_token'",
    ),
    (
        "variables too large",
        {"chat_template_kwargs": {"a": "x" * MAX_CHAT_TEMPLATE_KWARGS_BYTES}},
        "chat_template_kwargs has",
    ),
]


def _deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _wide_tools() -> list[dict[str, Any]]:
    properties = {f"p{i}": {"type": "string"} for i in range(300)}
    return [
        {
            "type": "function",
            "function": {
                "name": f"t{t}",
                "parameters": {"type": "object", "properties": properties},
            },
        }
        for t in range(8)
    ]


def bad_call(keywords: dict[str, Any]) -> dict[str, Any]:
    call: dict[str, Any] = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    call.update(keywords)
    if keywords.get("tools") == "wide":
        call["tools"] = _wide_tools()
    for tool in call["tools"] if isinstance(call["tools"], list) else []:
        if tool.get("function", {}).get("parameters") == "deep":
            tool["function"]["parameters"] = _deep(100)
    params = SamplingParams(max_tokens=4)
    if call.pop("structured", False):
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a"))
    call["sampling_params"] = params
    return call


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_each_bad_chat_is_refused_in_one_line_beside_a_healthy_one(
    smollm2: LoadedModel, anyio_backend: str
) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        for what, keywords, message in BAD:
            call = bad_call(keywords)
            messages = call.pop("messages")
            with pytest.raises(InvalidRequestError) as refused:
                await engine.chat(messages, **call)
            error = str(refused.value)
            assert error.startswith(message) or message in error, (what, error)
            assert "\n" not in error, what
            healthy = await engine.chat(
                ASK,
                SamplingParams(temperature=0, max_tokens=2),
                tools=[WEATHER],
                tool_choice="none",
            )
            assert healthy.outputs[0].token_ids, what
        left = engine.output_processor
        assert left.groups == {} and left.requests == {}  # nothing left behind


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_over_http_a_request_s_template_needs_the_server_s_trust(
    smollm2: LoadedModel, anyio_backend: str
) -> None:
    body = {
        "messages": ASK,
        "max_tokens": 2,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    async with asyncstep.open_engine(smollm2) as engine:
        for trusted in (False, True):
            app = build_app(engine, ServerConfig(trust_request_chat_template=trusted))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
                answer = await client.post("/v1/chat/completions", json=body)
                reserved = await client.post(
                    "/v1/chat/completions",
                    json={**body, "chat_template_kwargs": {"tools": []}},
                )
            if not trusted:
                assert answer.status_code == 400
                error = answer.json()["error"]
                assert error["param"] == "chat_template"
                assert "--trust-request-chat-template" in error["message"]
            else:
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["prompt_tokens"] == len(
                    await engine.encode_prompt(ASK, chat_template=body["chat_template"])
                )
                assert reserved.status_code == 400
                assert reserved.json()["error"]["param"] == "chat_template_kwargs"


def test_the_readme_s_chat_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/python-api.md's ``engine.chat`` example, as written (the embedded
    model, its own engine-core process): it prints the forced call it shows."""
    readme = (Path(__file__).parents[2] / "docs" / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    [example] = [b for b in blocks if "engine.chat(" in b]
    exec(compile("import trio\nimport asyncstep\n" + example, "README.md", "exec"), {})
    shown = re.search(r"# (tool_calls get_weather .*)", example)
    assert shown is not None
    assert capsys.readouterr().out.splitlines()[-1] == shown.group(1)
