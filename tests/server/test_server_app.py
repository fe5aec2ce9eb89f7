"""``asyncstep.server.build_app`` inside a service's own process: mounted
under a prefix of its own Starlette app and served by Hypercorn under
asyncio; under Trio, requests past ``max_waiting_requests`` get 429 (and the
server serves again once the queue has room); a model without a tokenizer
serves token ids; once the engine is dead, ``/health`` and the routes answer
503; ``asyncstep serve``'s first Ctrl-C says what the stop waits for, and
new requests meanwhile get 503; with two data-parallel replicas it outlives
one (``/health`` names it) and stops once both are dead."""

from __future__ import annotations

import ast
import json
import os
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import hypercorn.asyncio
import hypercorn.trio
import openai
import pytest
import trio
from hypercorn.config import Config
from processes import serving_url, wait_for, wait_gone
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

import asyncstep
from asyncstep import cli
from asyncstep.engine.transport.core_client import CoreProcess
from asyncstep.models.model_loader import LoadedModel
from asyncstep.server import OpenAIServer, ServerConfig, build_app

USER = [{"role": "user", "content": "What is the capital of France?"}]


def listening_socket() -> tuple[int, int]:
    """A loopback socket listening on a free port: (its fd, the port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    return sock.detach(), port


async def poll(check: Any, what: str, timeout_s: float = 10) -> None:
    with anyio.fail_after(timeout_s):
        while not await check():  # noqa: ASYNC110  # polling a server (HTTP), with a deadline
            await anyio.sleep(0.02)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_routes_mount_in_a_service_app_under_asyncio(smollm2: LoadedModel) -> None:
    async def ping(request: Request) -> PlainTextResponse:
        return PlainTextResponse("pong")

    async with asyncstep.open_engine(smollm2) as engine:
        llm = build_app(engine, ServerConfig(served_model_name=["smol", "smollm2"]))
        service = Starlette(routes=[Route("/ping", ping), Mount("/llm", app=llm)])
        fd, port = listening_socket()
        config = Config()
        config.bind = [f"fd://{fd}"]
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                partial(hypercorn.asyncio.serve, service, config, shutdown_trigger=stop.wait)
            )
            base = f"http://127.0.0.1:{port}"
            client = openai.AsyncOpenAI(base_url=base + "/llm/v1", api_key="none", max_retries=0)
            whole = await client.chat.completions.create(
                model="smollm2",
                messages=USER,
                max_tokens=12,
                temperature=0,  # type: ignore[arg-type]
            )
            assert whole.model == "smol"  # the first name is the one reported
            pieces = [
                chunk.choices[0].delta.content or ""
                async for chunk in await client.chat.completions.create(
                    model="smol",
                    messages=USER,  # type: ignore[arg-type]
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                )
            ]
            assert "".join(pieces) == whole.choices[0].message.content
            assert "Paris" in "".join(pieces)
            async with httpx.AsyncClient(base_url=base) as http:
                assert (await http.get("/ping")).text == "pong"
                assert (await http.get("/llm/health")).status_code == 200
                models = (await http.get("/llm/v1/models")).json()
                assert [m["id"] for m in models["data"]] == ["smol", "smollm2"]
            await client.close()
            stop.set()


@pytest.mark.trio
async def test_requests_past_max_waiting_get_429_until_there_is_room(
    smollm2: LoadedModel,
) -> None:
    long = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    async with asyncstep.open_engine(smollm2, max_num_seqs=1) as engine:
        server = OpenAIServer(engine, ServerConfig(max_waiting_requests=0))
        config = Config()
        config.bind = ["127.0.0.1:0"]
        async with trio.open_nursery() as nursery:
            (url,) = await nursery.start(hypercorn.trio.serve, server.app, config)
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json=long) as first:
                    assert first.status_code == 200
                    async for line in first.aiter_lines():
                        if line.startswith("data: {"):
                            break  # it runs: the one batch slot is taken
                    refused = await client.post("/v1/completions", json={"prompt": "Hi"})
                    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                    error = refused.json()["error"]
                    assert error["code"] == 429 and error["type"] == "rate_limit_error"
                    assert "waiting" in error["message"]
                # Leaving the stream drops its connection: the slot is free again.

                async def empty() -> bool:
                    return not server.in_flight

                await poll(empty, "the dropped stream to end")
                served = await client.post(
                    "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}
                )
                assert served.status_code == 200
                assert served.json()["usage"]["completion_tokens"] == 2
            nursery.cancel_scope.cancel()


@pytest.mark.trio
async def test_token_ids_without_a_tokenizer_then_503_once_the_engine_is_dead() -> None:
    options: dict[str, Any] = {"load_format": "dummy", "device": "cpu", "dtype": "float32"}
    with pytest.raises(asyncstep.EngineDeadError):
        async with asyncstep.open_engine("tiny-llama", **options) as engine:
            transport = httpx.ASGITransport(app=build_app(engine))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"prompt": [1, 2, 3], "max_tokens": 3, "logprobs": 1, "ignore_eos": True}
                out = (await client.post("/v1/completions", json=body)).json()
                (choice,) = out["choices"]
                assert out["usage"]["completion_tokens"] == 3 and choice["text"] == ""
                assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
                chat = await client.post("/v1/chat/completions", json={"messages": USER})
                assert chat.status_code == 400 and "tokenizer" in chat.json()["error"]["message"]
                assert (await client.get("/health")).status_code == 200

                assert isinstance(engine.core, CoreProcess) and engine.core.pid is not None
                generated = engine.statistics().num_generated_tokens
                long = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
                streams: list[httpx.Response] = []

                async def stream() -> None:
                    streams.append(await client.post("/v1/completions", json=long))

                async def streaming() -> bool:
                    return engine.statistics().num_generated_tokens > generated

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream)
                    await poll(streaming, "the stream to start")
                    os.kill(engine.core.pid, signal.SIGKILL)
                # The stream had begun: it ends with an error event, then [DONE].
                (cut,) = streams
                assert cut.status_code == 200 and cut.text.endswith("data: [DONE]\n\n")
                error = json.loads(cut.text.split("data: ")[-2])["error"]
                assert error["code"] == 503 and "engine" in error["message"]

                async def dead() -> bool:
                    return (await client.get("/health")).status_code == 503

                await poll(dead, "/health to say the engine is dead")
                refused = await client.post("/v1/completions", json=body)
                assert refused.status_code == 503
                assert "engine" in refused.json()["error"]["message"]


@pytest.mark.trio
async def test_max_tokens_past_the_context_is_a_400_naming_the_numbers(tiny_hf_dir: Path) -> None:
    """The engine's one rule (as from Python and the command line), the
    field given named; a request of several prompts is refused whole."""
    options: dict[str, Any] = {"device": "cpu", "dtype": "float32", "engine_process": False}
    async with asyncstep.open_engine(tiny_hf_dir, max_model_len=64, **options) as engine:
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def refused(path: str, body: dict[str, Any], param: str) -> str:
                response = await client.post(path, json=body)
                assert response.status_code == 400, response.text
                error = response.json()["error"]
                assert error["param"] == param, error
                return str(error["message"])

            body = {"prompt": [1, 2, 3], "max_tokens": 62}
            assert await refused("/v1/completions", body, "max_tokens") == (
                "max_tokens 62 does not fit: the prompt has 3 tokens and the model's context "
                "(max_model_len) is 64, which leaves 61: ask for at most 61"
            )
            both = body | {"prompt": [[1], [1, 2, 3]]}  # the first fits, the second not
            assert "leaves 61" in await refused("/v1/completions", both, "max_tokens")
            assert engine.statistics().num_finished_reqs == 0  # neither ran
            chat = {"messages": USER, "max_completion_tokens": 64}
            message = await refused("/v1/chat/completions", chat, "max_completion_tokens")
            assert message.startswith("max_tokens 64 does not fit: the prompt has ")
            whole = await client.post("/v1/completions", json=body | {"max_tokens": 61})
            assert whole.status_code == 200
            assert whole.json()["usage"]["completion_tokens"] <= 61


def test_serve_flags_make_the_server_config(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--host", "::1", "--port", "0", "--served-model-name", "a", "b"]
    args = cli.build_parser().parse_args([*argv, "--max-waiting-requests", "3"])
    monkeypatch.setenv("ASYNCSTEP_API_KEY", "from-env")
    config = cli.server_config_from_args(args)
    assert (config.host, config.port, config.bind) == ("::1", 0, "[::1]:0")
    assert config.served_model_name == ["a", "b"] and config.max_waiting_requests == 3
    assert config.api_key == "from-env"  # the environment, unless --api-key is given
    args = cli.build_parser().parse_args(["serve", "--api-key", "flag"])
    assert cli.server_config_from_args(args).api_key == "flag"
    # A bad value is one line on stderr, before any model loads; so is a port in use.
    assert cli.main(["serve", "--port", "70000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "port must be in [0, 65535]" in err
    assert cli.main(["serve", "--api-server-count", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "api_server_count must be in [1, 64], got 0" in err
    assert cli.main(["serve", "--port", "0", "--api-server-count", "2", "--no-engine-process"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "share an engine core only in its own process" in err
    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert cli.main(["serve", "--port", str(taken.getsockname()[1])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err


#: What the server package may import of asyncstep: the front end only.
FRONT_END = {
    "asyncstep",
    "asyncstep.checks",
    "asyncstep.cli",
    "asyncstep.config",
    "asyncstep.datatypes",
    "asyncstep.errors",
    "asyncstep.logging",
    "asyncstep.procs",
    "asyncstep.structured_params",
    "asyncstep.engine.front_end.api",
    "asyncstep.engine.front_end.data_parallel",
    "asyncstep.engine.front_end.engine",
    "asyncstep.engine.front_end.statistics",
    "asyncstep.engine.messages.outputs",
    # the chat's front end: tools, their parsers, the thinking apart
    "asyncstep.engine.chat.chat_replies",
    "asyncstep.engine.chat.reasoning",
    "asyncstep.engine.chat.tool_parsers",
    "asyncstep.engine.chat.tools",
}


def test_the_server_imports_only_the_front_end() -> None:
    package = Path(asyncstep.__file__).parent / "server"
    for module in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("asyncstep") and not name.startswith("asyncstep.server"):
                    assert name in FRONT_END, f"{module.name} imports {name}"


@pytest.mark.parametrize(("api_servers", "victim"), [(1, "core"), (2, "core"), (2, "api")])
def test_asyncstep_serve_exits_when_its_engine_or_an_api_server_dies(
    api_servers: int, victim: str
) -> None:
    """A supervisor sees a dead engine, or a dead API server: the server
    stops and exits 1 with one line, leaving no process behind."""
    argv = [sys.executable, "-m", "asyncstep", "serve", "--model", "tiny-llama", "--port", "0"]
    argv += ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32"]
    argv += ["--api-server-count", str(api_servers)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # blocks until serving (or the process ended)
        assert line.startswith("asyncstep: serving"), line
        tasks = Path(f"/proc/{server.pid}/task").glob("*/children")  # any thread's children
        children = {int(pid) for task in tasks for pid in task.read_text().split()}
        by_kind = {
            pid: "core" if b"core_process" in Path(f"/proc/{pid}/cmdline").read_bytes() else "api"
            for pid in children
        }
        assert len(children) == 1 + (api_servers if api_servers > 1 else 0)
        os.kill(next(pid for pid, kind in by_kind.items() if kind == victim), signal.SIGKILL)
        code = server.wait(timeout=30)
        stderr = server.stderr.read() if server.stderr is not None else ""
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert code == 1
    lines = [line for line in stderr.splitlines() if line.startswith("asyncstep: error:")]
    assert lines and "Traceback" not in stderr
    assert ("engine" if victim == "core" else "API server") in lines[-1]
    assert "SIGKILL" in lines[-1]
    for pid in children:
        assert wait_gone(pid, 15), f"process {pid} ({by_kind[pid]}) outlived the server"


def read_until(sock: socket.socket, marker: bytes, timeout_s: float = 60) -> bytes:
    sock.settimeout(timeout_s)
    got = b""
    while marker not in got:
        part = sock.recv(65536)
        assert part, f"connection closed before {marker!r}: {got!r}"
        got += part
    return got


def health(url: str) -> int | None:
    """``/health``'s status on a new connection (None: refused)."""
    try:
        return httpx.get(url + "/health").status_code
    except httpx.ConnectError:
        return None


@pytest.mark.parametrize("api_servers", [1, 2])
def test_the_first_ctrl_c_says_what_it_waits_for_and_new_requests_get_503(
    api_servers: int,
) -> None:
    """Random SmolLM2-sized weights in float32: 2000 tokens take far longer
    than the test's requests during the drain."""
    argv = [sys.executable, "-m", "asyncstep", "serve", "--port", "0", "--shutdown-timeout", "120"]
    argv += ["--load-format", "dummy", "--model", "smollm2-135m", "--device", "cpu"]
    argv += ["--dtype", "float32", "--weight-packing", "none", "--kv-cache-memory-gib", "0.1"]
    argv += ["--api-server-count", str(api_servers)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = serving_url(server, [])
        long = {"prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}
        data = json.dumps(long).encode()
        stream = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        stream.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        read_until(stream, b"data: {")
        server.send_signal(signal.SIGINT)
        # The drain: a new connection is still taken, and answered 503.
        wait_for(lambda: health(url) == 503, "/health to answer 503")
        refused = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["message"] == "the server is shutting down"
        server.send_signal(signal.SIGINT)  # the second: the stream is aborted at once
        assert b'"finish_reason":"abort"' in read_until(stream, b"data: [DONE]")
        stream.close()
        code = server.wait(timeout=60)
        assert server.stderr is not None
        err = server.stderr.read()
        assert code == 0, err
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    waited = "1 request in flight" if api_servers == 1 else "the requests in flight"
    line = f"asyncstep: stopping: waiting up to 120 s for {waited}; Ctrl-C again to abort them"
    assert [li for li in err.splitlines() if "stopping" in li] == [line], err
    assert "Traceback" not in err


def test_asyncstep_serve_outlives_one_data_parallel_replica_not_both() -> None:
    """``--data-parallel-size 2``: a replica's core killed, ``/health``
    names it and the other serves on; the last one killed stops the server
    (exit 1, one line), leaving no process behind."""
    argv = [sys.executable, "-m", "asyncstep", "serve", "--model", "tiny-llama", "--port", "0"]
    argv += ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32"]
    argv += ["--data-parallel-size", "2"]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()  # blocks until serving (or the process ended)
        assert line.startswith("asyncstep: serving"), line
        url = line.split()[-1]
        tasks = Path(f"/proc/{server.pid}/task").glob("*/children")  # any thread's children
        cores = sorted(int(pid) for task in tasks for pid in task.read_text().split())
        assert len(cores) == 2
        os.kill(cores[0], signal.SIGKILL)

        def one_dead() -> list[dict[str, Any]] | None:
            replicas: list[dict[str, Any]] = httpx.get(url + "/health").json()["replicas"]
            return replicas if sum(r["alive"] for r in replicas) == 1 else None

        replicas = wait_for(one_dead, "/health to name the dead replica")
        dead = next(r for r in replicas if not r["alive"])
        assert "SIGKILL" in dead["error"]
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True}
        for _ in range(2):  # both go to the live replica
            served = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        os.kill(cores[1], signal.SIGKILL)
        code = server.wait(timeout=30)
        stderr = server.stderr.read() if server.stderr is not None else ""
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert code == 1
    lines = [line for line in stderr.splitlines() if line.startswith("asyncstep: error:")]
    assert lines and "Traceback" not in stderr
    assert "SIGKILL" in lines[-1], lines
    for pid in cores:
        assert wait_gone(pid, 15), f"engine core {pid} outlived the server"
