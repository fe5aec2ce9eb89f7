"""The HTTP door (issue 22), as an attacker tries it: each attack on a real
``asyncstep serve`` (the embedded SmolLM2 on the CPU) beside a healthy
stream, whose text must agree with its text alone, whose largest gap between
chunks must stay within the harness's ``MAX_GAP_S`` (1 s, on CI's 2-core
machine), and with the server's processes growing at most its
``MAX_RSS_GROWTH_MIB`` (300 MiB) of peak RSS per attacking request (the
harness: :mod:`asyncstep.bench.door_harness`).

The attacks, scaled down where the behaviour is the same (the full-size ones
are ``python3 -m asyncstep.bench.door``): a prompt a few times past the byte
bound (text, chat, token ids), long text under the bound (tokenized off the event loop);
generation responses with ``Connection: close``, over HTTP/1.0 and kept alive
(the server must close each); JSON nested 100k deep in every place a body
nests (and schemas 10k deep); bodies sent a byte at a time (408, closed);
the trailing-slash redirect's ``Location``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from asyncstep.bench.door_harness import (
    Server,
    assert_healthy,
    beside_healthy_stream,
    deep_bodies,
    json_body,
    post_json,
    read_until_closed,
    reference_text,
    run_threads,
    send_request,
    serving,
    slow_body,
    status_of,
)

MAX_MODEL_LEN = 8192
#: The most bytes one token of SmolLM2's vocabulary stands for (a newline and 80 spaces).
TOKEN_BYTES = 81
#: Prompt text longer than this cannot fit the context (byte-level BPE: strict).
PROMPT_BYTE_BOUND = MAX_MODEL_LEN * TOKEN_BYTES
BODY_READ_TIMEOUT_S = 1.5
KEEP_ALIVE_TIMEOUT_S = 1.0
#: Chunks of the healthy stream alone, to compare with.
REFERENCE_CHUNKS = 12


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    args = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-gib", "0.25"]
    args += ["--body-read-timeout", str(BODY_READ_TIMEOUT_S)]
    args += ["--keep-alive-timeout", str(KEEP_ALIVE_TIMEOUT_S)]
    with serving(args) as running:
        yield running


@pytest.fixture(scope="module")
def reference(server: Server) -> str:
    """The healthy stream's text alone."""
    return reference_text(server.url, REFERENCE_CHUNKS)


def assert_error(body: Any, status: int, *words: str) -> None:
    """An error body of OpenAI's shape: its code, a one-line message holding ``words``."""
    error = body["error"]
    assert error["code"] == status and "\n" not in error["message"], error
    assert all(word in error["message"] for word in words), error


# -- length before work -------------------------------------------------------

OVERSIZED = 4 * PROMPT_BYTE_BOUND
PAST_THE_BOUND: dict[str, tuple[str, dict[str, Any], str]] = {
    "text": ("/v1/completions", {"prompt": "x" * OVERSIZED}, "bytes of text"),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * OVERSIZED}]},
        "bytes of text",
    ),
    "chat parts": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * OVERSIZED}]}]},
        "bytes of text",
    ),
    "tokenize": ("/tokenize", {"prompt": "x" * OVERSIZED}, "bytes of text"),
    "token ids": ("/v1/completions", {"prompt": [1] * (64 * MAX_MODEL_LEN)}, "tokens"),
}


@pytest.mark.parametrize("case", list(PAST_THE_BOUND))
def test_a_prompt_past_the_byte_bound_is_refused_untokenized(
    server: Server, reference: str, case: str
) -> None:
    path, body, words = PAST_THE_BOUND[case]
    response, health = beside_healthy_stream(server, lambda: post_json(server.url, path, body))
    assert response.status_code == 400, response.text[:300]
    assert_error(response.json(), 400, words)
    assert_healthy(health, reference)


def test_long_text_is_tokenized_off_the_event_loop(server: Server, reference: str) -> None:
    # Prompts that fit the context (6000 tokens: a newline and 80 spaces is
    # one token) but take about a CPU second each to tokenize; the request
    # is then refused by its max_tokens, past what the context leaves.
    prompt = ("\n" + " " * 80) * 6000
    body = {"prompt": [prompt] * 4, "max_tokens": MAX_MODEL_LEN - 100}
    response, health = beside_healthy_stream(
        server, lambda: post_json(server.url, "/v1/completions", body)
    )
    assert response.status_code == 400, response.text[:300]
    assert_error(response.json(), 400, "max_tokens 8092 does not fit", "prompt has 6000 tokens")
    assert_healthy(health, reference)


# -- connections --------------------------------------------------------------

GENERATIONS = {
    "whole": {"prompt": "Hi", "max_tokens": 1},
    "stream": {"prompt": "Hi", "max_tokens": 1, "stream": True},
    # Refused inside the response (the grammar is checked by the engine).
    "error": {
        "prompt": "Hi",
        "max_tokens": 1,
        "stream": True,
        "structured_outputs": {"regex": "("},
    },
}
CONNECTIONS = {
    "close": ("HTTP/1.1", ["connection: close"]),
    "http/1.0": ("HTTP/1.0", []),
    "keep-alive": ("HTTP/1.1", []),  # idle after the response: closed after the timeout
}


def test_connections_close_after_generation_responses(server: Server, reference: str) -> None:
    cases = [(g, c) for g in GENERATIONS for c in CONNECTIONS]

    def exchange(i: int) -> tuple[bytes, bool]:
        kind, connection = cases[i]
        version, headers = CONNECTIONS[connection]
        body = json.dumps(GENERATIONS[kind]).encode()
        sock = send_request(server.port, "POST", "/v1/completions", body, headers, version)
        return read_until_closed(sock, timeout_s=KEEP_ALIVE_TIMEOUT_S + 15)

    results, health = beside_healthy_stream(server, lambda: run_threads(len(cases), exchange))
    for (kind, connection), (response, closed) in zip(cases, results, strict=True):
        expected = 400 if kind == "error" else 200
        assert status_of(response) == expected, (kind, connection, response[:200])
        if kind == "stream":
            assert response.rstrip(b"\r\n0").endswith(b"data: [DONE]"), response[-100:]
        assert closed, f"{kind} over {connection}: the server kept the connection open"
    assert_healthy(health, reference, requests=len(cases))


# -- nested JSON --------------------------------------------------------------

DEEP_BODIES = deep_bodies(100_000, schema_depth=10_000)


def test_json_nested_100k_deep_is_a_400_everywhere(server: Server, reference: str) -> None:
    def attack() -> dict[str, Any]:
        return {
            case: post_json(server.url, path, body) for case, (path, body) in DEEP_BODIES.items()
        }

    responses, health = beside_healthy_stream(server, attack)
    wrong = {c: (r.status_code, r.text[:200]) for c, r in responses.items() if r.status_code != 400}
    assert not wrong, wrong
    for response in responses.values():
        assert_error(response.json(), 400)
    assert "internal error" not in server.log() and "Traceback" not in server.log()
    assert_healthy(health, reference, requests=len(DEEP_BODIES))


# -- slow bodies --------------------------------------------------------------

SLOW_CLIENTS = 4


def test_a_body_sent_a_byte_at_a_time_gets_408_and_its_connection_closed(
    server: Server, reference: str
) -> None:
    def slow_client(i: int) -> tuple[bytes, bool]:
        return slow_body(server.port, 1000, every_s=0.2, give_up_s=BODY_READ_TIMEOUT_S + 10)

    results, health = beside_healthy_stream(server, lambda: run_threads(SLOW_CLIENTS, slow_client))
    for response, closed in results:
        assert status_of(response) == 408, response[:200]
        assert_error(json_body(response), 408, "body")
        assert closed
    assert health.attack_s < BODY_READ_TIMEOUT_S + 5
    assert_healthy(health, reference, requests=SLOW_CLIENTS)


# -- the trailing-slash redirect ----------------------------------------------


def test_no_redirect_takes_its_location_from_the_host_header(
    server: Server, reference: str
) -> None:
    def attack() -> bytes:
        sock = send_request(server.port, "GET", "/v1/models/", headers=["host: evil.example"])
        response, _ = read_until_closed(sock, timeout_s=KEEP_ALIVE_TIMEOUT_S + 5)
        return response

    response, health = beside_healthy_stream(server, attack)
    head = response.split(b"\r\n\r\n", 1)[0].lower()
    assert b"location:" not in head and b"evil.example" not in response, response
    assert status_of(response) == 404
    assert_healthy(health, reference)
