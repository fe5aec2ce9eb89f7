"""``asyncstep serve`` as a service sees it: one real server (a subprocess,
the embedded SmolLM2 on the CPU, listening on 127.0.0.1) for the module,
driven with the real ``openai`` package (sync and async), raw sockets and
httpx: completions and chat completions, whole and streamed, n > 1,
log-probs, JSON-schema output, stop strings, usage; the models, health and
metrics routes (counters move by what was served); greedy text equal to
``asyncstep generate``'s; 32 streams at once; clients that drop their
connection (their requests stop running at once); bad requests (the right
status and error JSON, the server serving on); and, last, SIGTERM under
load (one line says what the stop waits for, new requests get 503 while it
drains, a clean exit 0). All of it against one server process, and again
against two API server processes sharing the port and one engine core."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from processes import serving_url, wait_for
from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024
BODY_LIMIT = 64 << 10
SHUTDOWN_TIMEOUT = 4


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    output: list[str]
    #: ``asyncstep generate --json`` of REFERENCE_PROMPTS, started with the server.
    reference: subprocess.Popen[str]
    api_servers: int

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
        if isinstance(body, bytes):
            return httpx.post(self.url + path, content=body, headers=headers, **kwargs)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample, as ``name`` or ``name{label=value}`` (model_name left out)."""
        text = httpx.get(self.url + "/metrics").text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                assert s.labels.get("model_name") == MODEL
                inner = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
                samples[f"{s.name}{{{inner}}}" if inner else s.name] = s.value
        return samples


#: Dense fp32 weights: a request's greedy text is the same alone and in any
#: batch (bf16 rounding and the packed weights of small steps can tip a near
#: tie), which these tests compare.
BATCH_INVARIANT = ["--dtype", "float32", "--weight-packing", "none"]
REFERENCE_PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "2 + 2 ="]
REFERENCE_TOKENS = 20


@pytest.fixture(scope="module", params=[1, 2], ids=["one_api_server", "two_api_servers"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The server (one process, or a supervisor of two API servers on one
    engine core), and ``asyncstep generate`` loading the same model meanwhile."""
    argv = [sys.executable, "-m", "asyncstep", "serve", "--port", "0"]
    argv += ["--api-server-count", str(request.param)]
    argv += ["--max-model-len", str(MAX_MODEL_LEN), "--max-request-body-bytes", str(BODY_LIMIT)]
    argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--kv-cache-memory-gib", "0.25"]
    argv += [*BATCH_INVARIANT, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    argv += ["--reasoning-parser", "qwen3"]
    env = os.environ | {"ASYNCSTEP_API_KEY": KEY}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    generate = [sys.executable, "-m", "asyncstep", "generate", "--json", "--no-engine-process"]
    generate += ["--max-tokens", str(REFERENCE_TOKENS), "--kv-cache-memory-gib", "0.05"]
    generate += BATCH_INVARIANT
    reference = subprocess.Popen(
        [*generate, *REFERENCE_PROMPTS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    output: list[str] = []
    url = serving_url(proc, output)
    yield Server(proc, url, output, reference, request.param)
    for child in (proc, reference):
        if child.poll() is None:
            child.kill()
        child.wait(10)


# -- the API ------------------------------------------------------------------


def test_models_health_and_version(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra is not None
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert httpx.get(server.url + "/version").json()["version"]
    assert "127.0.0.1" in server.url


def test_a_completion_counts_its_tokens(server: Server) -> None:
    prompt = "The quick brown fox"
    out = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.text
    tokens = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(tokens), 7)
    assert out.usage.total_tokens == len(tokens) + 7
    assert out.id.startswith("cmpl-") and out.model == MODEL
    # The tokens give back the text.
    echo = server.post("/detokenize", {"tokens": tokens}).json()["prompt"]
    assert echo.endswith(prompt)
    again = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=7, temperature=0, echo=True
    )
    assert again.choices[0].text.startswith(prompt)
    assert again.choices[0].text[len(prompt) :].startswith(choice.text[:5])


def test_a_chat_stream_is_the_whole_reply_in_pieces(server: Server) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,  # type: ignore[arg-type]
    )

    async def stream() -> tuple[list[Any], str]:
        async with server.async_client() as client:
            chunks = [
                chunk
                async for chunk in await client.chat.completions.create(
                    model=MODEL,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chunks, text

    chunks, text = asyncio.run(stream())
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_whole_and_streamed(server: Server) -> None:
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, seed=7, temperature=1.0
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens <= 18
    assert len({c.text for c in out.choices}) > 1  # seeds 7, 8, 9
    again = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, seed=7, temperature=1.0
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    texts = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=6, n=3, seed=7, stream=True
    ):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    assert texts == [c.text for c in out.choices] and finished == {0, 1, 2}
    # Several prompts: choice k of prompt i is choice i * n + k, whole or streamed.
    prompts = ["Red, green,", "One, two,"]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2, seed=3)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, n=2, seed=3)
    assert [c.text for c in batch.choices[2:]] == [c.text for c in alone.choices]
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=4, n=2, seed=3, stream=True
    ):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == [c.text for c in batch.choices]


def test_logprobs_of_completions_and_chats(server: Server) -> None:
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0 and top is not None
        assert token in top and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()))  # greedy: the sampled one is the top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and chat.usage is not None
    assert len(content.content) == chat.usage.completion_tokens
    for entry in content.content:
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert "".join(e.token for e in content.content).startswith(
        (chat.choices[0].message.content or "")[:3]
    )


def test_prompt_logprobs_and_echo_with_logprobs(server: Server) -> None:
    client = server.client()
    prompt = "The cat sat on the"
    tokens = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    assert out.choices[0].model_extra is not None
    positions = out.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(tokens) and positions[0] is None
    for token, position in zip(tokens[1:], positions[1:], strict=True):
        assert 2 <= len(position) <= 3 and position[str(token)]["logprob"] <= 0
        assert position[str(token)]["rank"] >= 1
    # echo, logprobs, max_tokens 0 (a log-likelihood): the prompt alone, with its log-probs.
    alone = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    lp = alone.choices[0].logprobs
    assert alone.choices[0].text == prompt and alone.usage is not None
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == len(tokens)
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(tokens) and lp.token_logprobs[0] is None
    expected = [p[str(t)]["logprob"] for t, p in zip(tokens[1:], positions[1:], strict=True)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    # With an output: the prompt's tokens, then the output's; whole or streamed.
    both = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    assert both.choices[0].text == prompt + out.choices[0].text
    assert both.choices[0].logprobs is not None and both.choices[0].logprobs.tokens is not None
    assert len(both.choices[0].logprobs.tokens) == len(tokens) + 3
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=3,
            echo=True,
            logprobs=1,
            temperature=0,
            stream=True,
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == both.choices[0].text
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens or [])]  # type: ignore[union-attr]
    assert streamed == both.choices[0].logprobs.tokens
    # A chat's prompt log-probs are the response's (vLLM's place for them).
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_extra is not None and chat.usage is not None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_a_json_schema_reply_parses_and_validates(server: Server) -> None:
    """response_format (json_schema, json_object) and vLLM's structured_outputs
    constrain the output (they need the engine's structured-output support);
    a schema's reply is standard JSON (no blank lines, no space before a
    comma, sampled or not), compact with ``disable_any_whitespace``."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    client = server.client()
    person = [{"role": "user", "content": "Invent a person: their name and age."}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=person,  # type: ignore[arg-type]
        max_tokens=128,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema},
        },
    )
    reply = json.loads(out.choices[0].message.content or "")
    jsonschema.validate(reply, schema)
    assert out.choices[0].finish_reason == "stop"
    # Sampled (where any whitespace let the model write blank lines and
    # spaces before commas): standard JSON, indented by 2.
    sampled = client.chat.completions.create(
        model=MODEL,
        messages=person,  # type: ignore[arg-type]
        max_tokens=96,
        temperature=1.0,
        seed=0,
        n=8,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema},
        },
    )
    for choice in sampled.choices:
        text = choice.message.content or ""
        between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # the whitespace outside strings
        assert "\n\n" not in between and not re.search(r"\s,", between), text
        if choice.finish_reason == "stop":
            assert text == json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    compact = client.chat.completions.create(
        model=MODEL,
        messages=person,  # type: ignore[arg-type]
        max_tokens=128,
        temperature=0,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    text = compact.choices[0].message.content or ""
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
    anything = client.chat.completions.create(
        model=MODEL,
        messages=person,  # type: ignore[arg-type]
        max_tokens=128,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
    choice = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert choice.choices[0].text in ("yes", "no")


def test_a_named_tool_call_is_forced_and_streams_as_openai_s(server: Server) -> None:
    """A named function's call: its arguments follow its parameters' schema;
    streamed, the id and name come first, then the arguments in pieces, which
    add up to the whole reply's."""
    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ask,
        "tools": [WEATHER, TIME],
        "tool_choice": named("get_weather"),
        "max_tokens": 96,
        "temperature": 0,
    }
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)  # type: ignore[union-attr]
    assert out.usage is not None and out.usage.completion_tokens > 0
    pieces = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in pieces if c.choices]
    first = deltas[0].tool_calls[0]  # type: ignore[index]
    assert first.id and first.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = "".join(
        (d.tool_calls[0].function.arguments or "")
        for d in deltas
        if d.tool_calls  # type: ignore[union-attr]
    )
    assert arguments == call.function.arguments  # type: ignore[union-attr]
    assert pieces[-1].choices[0].finish_reason == "tool_calls"
    assert all(not d.content for d in deltas)


def never_closed() -> dict[str, float]:
    """A ``logit_bias`` against every token of the model that holds a ``]``:
    a ``required`` list then never closes and calls follow calls until
    ``max_tokens`` cuts the reply (what a small model does by itself at
    times); a list of one call (``parallel_tool_calls`` false) must still
    close, the grammar allowing nothing else."""
    from asyncstep.models.loader import open_checkpoint

    vocabulary = open_checkpoint(None).load_tokenizer().get_vocab()
    return {str(i): -100.0 for token, i in vocabulary.items() if "]" in token}


def test_required_tool_calls_validate_whatever_is_sampled(server: Server) -> None:
    """``required``: every call of every sampled reply names a tool and its
    arguments validate against that tool's schema; at most one call without
    parallel_tool_calls; streamed, each call comes whole as soon as it is
    complete, and no chunk is empty. A list cut by ``max_tokens`` keeps the
    calls it completed, whole and streamed (finish reason ``length``, no
    content); with parallel_tool_calls false the grammar closes the list
    after one call."""
    schemas = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
    ask = [{"role": "user", "content": "Weather in Oslo, and the time in Tokyo?"}]
    endless: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "max_tokens": 100,
        "temperature": 0,
        "logit_bias": never_closed(),
    }

    async def sampled(client: openai.AsyncOpenAI, seed: int) -> Any:
        return await client.chat.completions.create(
            model=MODEL,
            messages=ask,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            parallel_tool_calls=seed % 2 == 0,
            max_tokens=160,
            temperature=1.0,
            seed=seed,
        )

    async def streamed(client: openai.AsyncOpenAI) -> list[Any]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=ask,  # type: ignore[arg-type]
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice="required",
            max_tokens=160,
            temperature=0,
            stream=True,
        )
        return [chunk async for chunk in stream]

    async def endless_streamed(client: openai.AsyncOpenAI) -> list[Any]:
        stream = await client.chat.completions.create(**endless, stream=True)
        return [chunk async for chunk in stream]

    async def all_at_once() -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        """The four sampled replies and the streamed one; the endless list
        whole, streamed, and with one call allowed: in one batch (dense fp32:
        the endless list's greedy tokens are the same in any batch)."""
        async with server.async_client() as client:
            *outs, pieces, cut, cut_pieces, single = await asyncio.gather(
                *(sampled(client, seed) for seed in range(4)),
                streamed(client),
                client.chat.completions.create(**endless),
                endless_streamed(client),
                client.chat.completions.create(**endless, parallel_tool_calls=False),
            )
        return outs, pieces, [cut, single], cut_pieces

    outs, pieces, [cut, single], cut_pieces = asyncio.run(all_at_once())
    for seed, out in enumerate(outs):
        choice = out.choices[0]
        calls = choice.message.tool_calls or []
        assert not choice.message.content  # cut short too: the calls it completed, if any
        assert choice.finish_reason == "length" or (choice.finish_reason == "tool_calls" and calls)
        assert seed % 2 == 0 or len(calls) == 1
        for call in calls:
            name = call.function.name
            jsonschema.validate(json.loads(call.function.arguments), schemas[name])
    check_streamed_calls(pieces, schemas)
    made = cut.choices[0].message.tool_calls or []
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.content
    assert len(made) >= 2
    assert check_streamed_calls(cut_pieces, schemas) == [
        (c.function.name, c.function.arguments) for c in made
    ]
    assert cut_pieces[-1].choices[0].finish_reason == "length"
    [one] = single.choices[0].message.tool_calls or []
    assert single.choices[0].finish_reason == "tool_calls"
    assert one.function.arguments == made[0].function.arguments


def check_streamed_calls(pieces: list[Any], schemas: dict[str, Any]) -> list[tuple[str, str]]:
    """A streamed ``required`` reply: the role first, then no chunk without
    something new; no content; each call one delta (id, name, its whole
    arguments, valid) before the last chunk unless the last completed it.
    Its calls' names and arguments."""
    deltas = [p.choices[0].delta for p in pieces if p.choices]
    assert deltas[0].role == "assistant"
    ends = [p.choices[0].finish_reason for p in pieces if p.choices]
    assert all(d.tool_calls or end for d, end in zip(deltas[1:], ends[1:], strict=True))
    assert not any(d.content for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert [c.index for c in calls] == list(range(len(calls)))
    made = []
    for call in calls:
        assert call.id and call.function and call.function.name and call.function.arguments
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        made.append((call.function.name, call.function.arguments))
    first = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert first < len(deltas) - 1 or len(calls) == 1  # as soon as it was complete
    return made


def test_auto_tool_calls_are_read_by_the_parser(server: Server) -> None:
    """``auto`` with the hermes parser: a reply that writes a call (made so
    here by a regex: a small model rarely does) comes back as the call,
    whole and streamed; a reply that writes none is content."""
    client = server.client()
    call = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'
    reply = f"<tool_call>{call}</tool_call>"
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ask,
        "tools": [WEATHER],
        "max_tokens": 200,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": re.escape(reply)}},
    }
    out = client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Rome", "unit": "celsius"}  # type: ignore[union-attr]
    pieces = list(client.chat.completions.create(**kwargs, stream=True))
    calls = [tc for c in pieces if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments or "") == {"city": "Rome", "unit": "celsius"}  # type: ignore[union-attr]
    assert not "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert pieces[-1].choices[0].finish_reason == "tool_calls"
    kwargs["extra_body"] = {"structured_outputs": {"regex": "It is sunny in Rome\\."}}
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].message.content == "It is sunny in Rome."
    assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason == "stop"


def test_thinking_goes_to_reasoning_content(server: Server) -> None:
    """``--reasoning-parser qwen3``: a reply that thinks first (made so by a
    regex) has its thinking in ``reasoning_content``, whole and streamed;
    replies that do not think are unchanged (every other test here)."""
    client = server.client()
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 64,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": "<think>Rome is hot\\.</think>Sunny\\."}},
    }
    out = client.chat.completions.create(**kwargs)
    message = out.choices[0].message
    assert message.content == "Sunny."
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == (
        "Rome is hot."
    )
    pieces = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in pieces if c.choices]
    thinking = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert thinking.strip() == "Rome is hot."
    assert "".join(d.content or "" for d in deltas) == "Sunny."


def test_a_tool_loop_runs_to_its_answer(server: Server) -> None:
    """call -> the tool's result -> an answer: the history with the
    assistant's call and the tool message is taken, and answered in text."""
    client = server.client()
    history: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Rome?"}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=96,
        temperature=0,
    )
    [call] = out.choices[0].message.tool_calls or []
    history.append(out.choices[0].message.model_dump(exclude_none=True))
    history.append({"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"})
    answer = client.chat.completions.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="none",
        max_tokens=24,
        temperature=0,
    )
    assert answer.choices[0].message.content
    assert not answer.choices[0].message.tool_calls


def test_stop_strings_end_the_text_before_them(server: Server) -> None:
    client = server.client()
    free = client.completions.create(
        model=MODEL, prompt="My favourite fruits are", max_tokens=24, temperature=0
    ).choices[0]
    words = free.text.split()
    stop = " " + words[min(3, len(words) - 1)]
    cut = client.completions.create(
        model=MODEL, prompt="My favourite fruits are", max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra is not None
    assert cut.model_extra["stop_reason"] == stop
    assert cut.text == free.text[: free.text.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="My favourite fruits are",
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=True,
        )
    )
    assert streamed == cut.text


def test_metrics_move_by_what_was_served(server: Server) -> None:
    before = server.metrics()
    out = server.client().completions.create(
        model=MODEL,
        prompt="Count: one, two,",
        max_tokens=5,
        n=2,
        temperature=0.8,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    after = wait_for(
        lambda: (m := server.metrics())["asyncstep:num_requests_running"] == 0 and m,
        "the request to be done",
    )
    assert out.usage is not None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("asyncstep:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("asyncstep:generation_tokens_total") == out.usage.completion_tokens == 10
    assert delta("asyncstep:request_success_total{finished_reason=length}") == 2
    assert delta("asyncstep:e2e_request_latency_seconds_count") == 1
    assert delta("asyncstep:time_to_first_token_seconds_count") == 1
    assert delta("asyncstep:inter_token_latency_seconds_count") == 10 - 2  # after each first
    assert after["asyncstep:num_requests_waiting"] == 0
    assert after["asyncstep:kv_cache_usage_perc"] == 0
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"vllm:{name}"] == after[f"asyncstep:{name}"]  # the routers' names
    assert 0 <= after["asyncstep:prefix_cache_hit_rate"] <= 1


def test_greedy_text_is_asyncstep_generate_s(server: Server) -> None:
    out, err = server.reference.communicate(timeout=120)
    assert server.reference.returncode == 0, err
    expected = [json.loads(line)["text"] for line in out.splitlines()]
    client = server.client()
    got = [
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": p}],
            max_tokens=REFERENCE_TOKENS,
            temperature=0,
        )
        .choices[0]
        .message.content
        for p in REFERENCE_PROMPTS
    ]
    assert got == expected and all(expected)


def test_32_streams_at_once(server: Server) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        text, tokens, finish = "", 0, None
        async for chunk in await client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens, finish

    async def all_of_them() -> list[tuple[str, int, str | None]]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert all(tokens == 8 and finish == "length" and text for text, tokens, finish in results)
    alone = server.client().completions.create(
        model=MODEL,
        prompt="Story number 5:",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert results[5][0] == alone.choices[0].text


# -- clients that go away -----------------------------------------------------


def raw_request(server: Server, path: str, body: dict[str, Any]) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {KEY}\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout_s: float = 30) -> bytes:
    sock.settimeout(timeout_s)
    got = b""
    while marker not in got:
        part = sock.recv(65536)
        assert part, f"connection closed before {marker!r}: {got!r}"
        got += part
    return got


LONG = {"prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True}


def running(server: Server) -> float:
    return server.metrics()["asyncstep:num_requests_running"]


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_a_client_dropping_its_stream_frees_its_request(server: Server, reset: bool) -> None:
    aborted = server.metrics().get("asyncstep:request_success_total{finished_reason=abort}", 0)
    sock = raw_request(server, "/v1/completions", LONG | {"stream": True})
    assert b" 200 " in read_until(sock, b"data: {")
    assert running(server) == 1
    if reset:  # RST instead of FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    # 900 tokens would take far longer than this on a CPU.
    after = wait_for(
        lambda: (m := server.metrics())["asyncstep:num_requests_running"] == 0 and m,
        "the dropped stream to stop running",
        timeout_s=10,
    )
    assert after["asyncstep:kv_cache_usage_perc"] == 0
    assert after["asyncstep:request_success_total{finished_reason=abort}"] == aborted + 1


@pytest.mark.parametrize("reset", [False, True], ids=["close", "reset"])
def test_a_client_dropping_a_whole_request_frees_it(server: Server, reset: bool) -> None:
    sock = raw_request(server, "/v1/completions", LONG)
    wait_for(lambda: running(server) == 1, "the request to run")
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    wait_for(lambda: running(server) == 0, "the dropped request to stop", timeout_s=10)
    assert server.metrics()["asyncstep:kv_cache_usage_perc"] == 0


# -- bad requests -------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


WEATHER_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = tool("get_weather", WEATHER_PARAMETERS)
TIME_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 40}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TIME = tool("get_time", TIME_PARAMETERS)


BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    ("malformed JSON", COMPLETIONS, b'{"prompt": "hi",', 400, None),
    ("not an object", COMPLETIONS, b"[1, 2]", 400, None),
    ("not UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None),
    ("wrong type", COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("missing field", CHAT, {"model": MODEL}, 400, None),
    ("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("negative temperature", CHAT, {"messages": USER, "temperature": -1}, 400, "temperature"),
    ("top_p of 0", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("n of 0", COMPLETIONS, {"prompt": "hi", "n": 0}, 400, "n"),
    ("too many logprobs", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (
        "negative prompt_logprobs",
        CHAT,
        {"messages": USER, "prompt_logprobs": -1},
        400,
        "prompt_logprobs",
    ),
    ("top_logprobs alone", CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    (
        "image content",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
    ),
    ("bad role type", CHAT, {"messages": [{"role": 3, "content": "x"}]}, 400, "messages"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("mixed prompt list", COMPLETIONS, {"prompt": ["a", 1]}, 400, "prompt"),
    ("too many prompts", COMPLETIONS, {"prompt": ["a"] * 1025}, 400, "prompt"),
    ("prompt too long", COMPLETIONS, {"prompt": [5] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    (
        "max_tokens past the context",
        CHAT,
        {"messages": USER, "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    ("negative seed", COMPLETIONS, {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("empty stop string", COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (
        "presence_penalty of 3",
        CHAT,
        {"messages": USER, "presence_penalty": 3},
        400,
        "presence_penalty",
    ),
    ("logit_bias key", COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (
        "logit_bias token outside",
        COMPLETIONS,
        {"prompt": "hi", "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
    ),
    (
        "...in a stream",
        COMPLETIONS,
        {"prompt": "hi", "stream": True, "logit_bias": {"99999": 1}},
        400,
        "logit_bias",
    ),
    (
        "response_format type",
        CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    (
        "schema not an object",
        CHAT,
        {
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}},
        },
        400,
        "response_format",
    ),
    (
        "two structured kinds",
        CHAT,
        {"messages": USER, "structured_outputs": {"regex": "a+", "choice": ["a"]}},
        400,
        "structured_outputs",
    ),
    (
        "stream_options alone",
        CHAT,
        {"messages": USER, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("suffix", COMPLETIONS, {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    (
        "tool_choice of no tool",
        CHAT,
        {"messages": USER, "tools": [WEATHER], "tool_choice": named("get_time")},
        400,
        None,
    ),
    ("required without tools", CHAT, {"messages": USER, "tool_choice": "required"}, 400, None),
    (
        "tool name",
        CHAT,
        {"messages": USER, "tools": [tool("bad name!")], "tool_choice": "required"},
        400,
        "tools",
    ),
    (
        "two tools of one name",
        CHAT,
        {"messages": USER, "tools": [WEATHER, WEATHER], "tool_choice": "required"},
        400,
        "tools",
    ),
    (
        "too many tools",
        CHAT,
        {"messages": USER, "tools": [tool(f"t{i}") for i in range(129)]},
        400,
        "tools",
    ),
    (
        "parameters not an object schema",
        CHAT,
        {"messages": USER, "tools": [tool("x", {"type": "string"})], "tool_choice": "required"},
        400,
        "tools",
    ),
    (
        "a tool message answering nothing",
        CHAT,
        {"messages": [*USER, {"role": "tool", "tool_call_id": "c1", "content": "x"}]},
        400,
        "messages",
    ),
    (
        "a forced call and a response_format",
        CHAT,
        {
            "messages": USER,
            "tools": [WEATHER],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        400,
        "tool_choice",
    ),
    ("detokenize outside the vocabulary", "/detokenize", {"tokens": [1, -5]}, 400, "tokens"),
    ("tokenize nothing", "/tokenize", {}, 400, "prompt"),
    ("oversized body", COMPLETIONS, {"prompt": "x" * BODY_LIMIT}, 413, None),
    ("no such route", "/v1/embeddings", {"input": "hi"}, 404, None),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_a_bad_request_gets_its_status_and_error_json(
    server: Server, path: str, body: Any, status: int, param: str | None
) -> None:
    response = server.post(path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert "\n" not in error["message"]
    assert error["code"] == status and isinstance(error["type"], str)
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(server.url + "/health").status_code == 200


def test_methods_and_keys_are_checked(server: Server) -> None:
    wrong_method = httpx.get(server.url + COMPLETIONS)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == 405
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        response = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi"}, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope").models.list()
    # And after every refusal it still serves.
    out = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert out.usage is not None and out.usage.completion_tokens >= 1


# -- stopping (last: it ends the server) --------------------------------------


def test_sigterm_under_load_finishes_short_requests_aborts_long_ones(server: Server) -> None:
    longs = [raw_request(server, COMPLETIONS, LONG | {"stream": True}) for _ in range(3)]
    for sock in longs:
        read_until(sock, b"data: {")
    # Short: sent once the long ones stream (sent before them, it could end
    # before they start: two API servers may pass it on first), a few dozen
    # decode steps beside them, still running when the poll below sees it,
    # and well inside the grace period even where the model runs dense
    # float32 on two cores.
    short = raw_request(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 24, "ignore_eos": True})
    wait_for(lambda: running(server) == 4, "every request to run")
    server.proc.send_signal(signal.SIGTERM)
    # While it drains, a new connection is taken and told 503.
    wait_for(lambda: health(server) == 503, "/health to answer 503", timeout_s=10)
    refused = server.post(COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == 503
    # The short request finishes in the grace period, whole.
    reply = read_until(short, b'"usage"')
    assert b'"finish_reason":"length"' in reply and b'"completion_tokens":24' in reply
    # The long ones are aborted after it, and end cleanly.
    for sock in longs:
        tail = read_until(sock, b"data: [DONE]", timeout_s=SHUTDOWN_TIMEOUT + 20)
        assert b'"finish_reason":"abort"' in tail
    assert server.proc.wait(30) == 0, "".join(server.output)
    assert health(server) is None  # the listener closed once the drain was over
    # One line said what the stop waits for (the supervisor's, of two API servers).
    waited = "4 requests" if server.api_servers == 1 else "the requests"
    line = f"asyncstep: stopping: waiting up to {SHUTDOWN_TIMEOUT} s for {waited} in flight"
    said = [li.rstrip("\n") for li in server.output if li.startswith("asyncstep: stopping")]
    assert said == [f"{line}; SIGTERM again to abort them"]


def health(server: Server) -> int | None:
    """``/health``'s status on a new connection (None: refused)."""
    try:
        return httpx.get(server.url + "/health", timeout=10).status_code
    except httpx.ConnectError:
        return None
