"""The OpenAI-compatible routes over one :class:`~asyncstep.engine.front_end.engine.Engine`.

:func:`build_app` gives a Starlette app (on AnyIO: it runs under Trio or
asyncio, alone or mounted in a service's own ASGI app):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: whole, or
  streamed as server-sent events (``stream_options.include_usage``: a last
  chunk with the usage);
* ``GET /v1/models``; ``GET /health`` (503 once the engine is dead or the
  server drains; with data-parallel replicas, 200 while one lives, its
  body ``{"replicas": [{"replica": 0, "alive": true, "error": null}, ...]}``
  saying which died and why); ``GET /metrics`` (:mod:`asyncstep.server.metrics`);
  ``POST /tokenize``, ``POST /detokenize``; ``GET /version``.

A request is read (at most ``max_request_body_bytes``: else 413; within
``body_read_timeout`` seconds: else 408, and the connection closes), decoded
(a bad body or field: 400), matched to a served model name (else 404),
turned into engine requests (:mod:`asyncstep.server.requests`: what the
engine refuses is a 400), then admitted and served
(:mod:`asyncstep.server.generation`: 429 past ``max_waiting_requests``; a
client that disconnects aborts its request). Errors have OpenAI's JSON
shape (:mod:`asyncstep.server.errors`).

:meth:`OpenAIServer.drain` is the graceful stop: new requests get 503,
those in flight may finish for a while, then are aborted (they end with
finish reason ``abort``).
"""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from asyncstep.engine.chat.chat_replies import ReplyReader
from asyncstep.engine.chat.reasoning import ReasoningParser
from asyncstep.engine.chat.tool_parsers import ToolParser, tool_parser
from asyncstep.engine.front_end.data_parallel import DataParallelEngine, ServedEngine
from asyncstep.errors import InvalidRequestError, describe
from asyncstep.logging import get_logger
from asyncstep.server import sse
from asyncstep.server.config import ServerConfig
from asyncstep.server.errors import APIError, api_error, bad_request, error_body
from asyncstep.server.generation import GenerationResponse, Generations, InFlight
from asyncstep.server.metrics import CONTENT_TYPE, ServerMetrics
from asyncstep.server.protocol import (
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    decode_body,
)
from asyncstep.server.requests import (
    GenerationJob,
    chat_job,
    chat_messages,
    completion_job,
)
from asyncstep.server.responses import (
    ChatFormatter,
    CompletionFormatter,
    TokenTexts,
)

log = get_logger("server")

#: The embedded model's name in the API (when ``--model`` is not given).
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
#: How long ``/metrics`` waits for the engine's counters when idle.
METRICS_REFRESH_S = 0.5


def build_app(engine: ServedEngine, config: ServerConfig | None = None) -> Starlette:
    """The OpenAI-compatible app over ``engine`` (its :class:`OpenAIServer`
    is ``app.state.openai_server``)."""
    return OpenAIServer(engine, config).app


def default_model_name(engine: ServedEngine) -> str:
    return engine.config.model.model or EMBEDDED_MODEL_NAME


class OpenAIServer:
    """The routes and the state of one server over one engine."""

    def __init__(self, engine: ServedEngine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.model_names = list(self.config.served_model_name or [default_model_name(engine)])
        self.model_name = self.model_names[0]
        self.metrics = ServerMetrics(engine, self.model_name)
        self.texts = TokenTexts(engine.tokenizer)
        self.generations = Generations(engine, self.metrics, self.config)
        #: ``tool_choice: auto``'s parser (None: auto is refused).
        self.tool_parser: ToolParser | None = None
        if self.config.enable_auto_tool_choice:
            self.tool_parser = tool_parser(self.config.tool_call_parser)
        #: The engine's ``--reasoning-parser`` (None: the thinking stays in the content).
        self.reasoning = ReasoningParser.of(engine.config)
        self._created = int(time.time())
        routes = [
            Route("/v1/completions", self._guarded(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._guarded(self.chat_completions), methods=["POST"]),
            Route("/v1/models", self._guarded(self.models), methods=["GET"]),
            Route("/health", self._open(self.health), methods=["GET"]),
            Route("/metrics", self._open(self.metrics_text), methods=["GET"]),
            Route("/tokenize", self._guarded(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._guarded(self.detokenize), methods=["POST"]),
            Route("/version", self._open(self.version), methods=["GET"]),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        )
        # No redirect of ``/v1/models/`` to ``/v1/models``: Starlette builds
        # its ``Location`` from the client's ``Host`` header.
        self.app.router.redirect_slashes = False
        self.app.state.openai_server = self

    @property
    def in_flight(self) -> dict[str, InFlight]:
        """Generation requests being served, by response id."""
        return self.generations.in_flight

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait up to ``timeout_s`` for those in
        flight, then abort what is left (responses end with ``abort``)."""
        await self.generations.drain(timeout_s)

    def abort_all(self) -> None:
        self.generations.abort_all()

    # -- routes ---------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = decode_body(await self._body(request), CompletionRequest)
        self._check_model(body.model)
        job = await completion_job(self.engine, body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        echo = [self._prompt_text(job, i) for i in range(len(job.prompts))] if job.echo else None
        fmt = CompletionFormatter(
            request_id=rid,
            created=int(time.time()),
            model=self.model_name,
            texts=self.texts,
            logprobs=job.logprobs,
            n=job.n,
            prompt_ids=job.prompts,
            prompt_logprobs=job.prompt_logprobs,
            echo_texts=echo,
            hide_output=job.hide_output,
        )
        return GenerationResponse(self.generations, job, fmt, rid)

    async def chat_completions(self, request: Request) -> Response:
        body = decode_body(await self._body(request), ChatCompletionRequest)
        self._check_model(body.model)
        job = await chat_job(
            self.engine,
            body,
            self.tool_parser,
            trust_chat_template=self.config.trust_request_chat_template,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormatter(
            rid,
            int(time.time()),
            self.model_name,
            self.texts,
            job.logprobs is not None,
            job.prompt_logprobs,
            ReplyReader(job.tool_calls, self.reasoning),
        )
        return GenerationResponse(self.generations, job, fmt, rid)

    async def models(self, request: Request) -> Response:
        root = self.engine.config.model.model
        cards = [
            ModelCard(
                id=name, created=self._created, root=root, max_model_len=self.engine.max_model_len
            )
            for name in self.model_names
        ]
        return _json(ModelList(data=cards))

    async def health(self, request: Request) -> Response:
        self.generations.check_serving()
        if isinstance(self.engine, DataParallelEngine):
            body = msgspec.json.encode({"replicas": self.engine.replicas()})
            return Response(body, media_type="application/json")
        return Response(status_code=200)

    async def metrics_text(self, request: Request) -> Response:
        if not self.in_flight and self.engine.error is None:
            # The engine's counters come with each step; refresh them when
            # no step may be coming (the last request just ended).
            with anyio.move_on_after(METRICS_REFRESH_S), contextlib.suppress(Exception):
                await self.engine.wait_idle()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        body = decode_body(await self._body(request), TokenizeRequest)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give prompt or messages (one of them)", "prompt")
        if body.messages is not None:
            tokens = await self.engine.encode_prompt(chat_messages(body.messages))
        else:
            self._tokenizer()
            tokens = await self.engine.input_processor.tokenize(
                body.prompt or "", add_special_tokens=body.add_special_tokens
            )
        return _json(
            TokenizeResponse(
                count=len(tokens), max_model_len=self.engine.max_model_len, tokens=tokens
            )
        )

    async def detokenize(self, request: Request) -> Response:
        body = decode_body(await self._body(request), DetokenizeRequest)
        self._check_model(body.model)
        vocab = self.engine.arch_config.vocab_size
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise bad_request(f"tokens must be in [0, {vocab}), got {outside[0]}", "tokens")
        return _json(DetokenizeResponse(prompt=self._tokenizer().decode(body.tokens)))

    async def version(self, request: Request) -> Response:
        from asyncstep import __version__

        return Response(
            msgspec.json.encode({"version": __version__}), media_type="application/json"
        )

    # -- request checks -------------------------------------------------------

    def _guarded(self, route: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
        """A route behind the API key (when there is one): every route but
        ``/health``, ``/metrics`` and ``/version``."""
        opened = self._open(route)

        async def endpoint(request: Request) -> Response:
            key = self.config.api_key
            if key is not None:
                given = request.headers.get("authorization", "")
                scheme, _, token = given.partition(" ")
                if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), key.encode()
                ):
                    what = "invalid API key" if given else "missing API key"
                    return _error(
                        APIError(
                            HTTPStatus.UNAUTHORIZED,
                            f"{what}: send 'Authorization: Bearer <key>'",
                            headers={"www-authenticate": "Bearer"},
                        )
                    )
            return await opened(request)

        return endpoint

    def _open(self, route: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
        """A route whose errors are answered in OpenAI's shape."""

        async def endpoint(request: Request) -> Response:
            try:
                return await route(request)
            except APIError as exc:
                return _error(exc)
            except BodyError as exc:
                return _error(bad_request(str(exc), exc.param))
            except InvalidRequestError as exc:
                return _error(api_error(exc))
            except ClientDisconnect:
                return Response(status_code=400)  # nobody is left to read it

        return endpoint

    async def _body(self, request: Request) -> bytes:
        """The request's body, refused with 413 past the limit (by its
        declared length first, then as it arrives), and with 408 (closing
        the connection) once it has taken ``body_read_timeout`` seconds."""
        limit = self.config.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request(f"bad content-length header {declared!r}")
            if int(declared) > limit:
                raise _too_large(int(declared), limit)
        parts, size = [], 0
        timeout = self.config.body_read_timeout
        with anyio.move_on_after(timeout) as reading:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise _too_large(size, limit)
                parts.append(part)
        if reading.cancelled_caught:
            raise APIError(
                HTTPStatus.REQUEST_TIMEOUT,
                f"the request body took longer than {timeout:g} s to arrive ({size} bytes came)",
                headers={"connection": "close"},
            )
        return b"".join(parts)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"the model {name!r} does not exist (this server serves {served})",
                param="model",
            )

    def _tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return self.engine.tokenizer

    def _prompt_text(self, job: GenerationJob, i: int) -> str:
        text = job.texts[i]
        if text is not None:
            return text
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else str(tokenizer.decode(job.prompts[i]))


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        f"request body of {size} bytes is larger than the limit ({limit} bytes)",
    )


def _json(body: msgspec.Struct) -> Response:
    return Response(sse.encode(body), media_type="application/json")


def _error(error: APIError) -> Response:
    return Response(
        error.body(), status_code=error.status, headers=error.headers, media_type="application/json"
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (no such route: 404; wrong method: 405)."""
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed here"}
    return Response(
        error_body(exc.status_code, message.get(exc.status_code, str(exc.detail))),
        status_code=exc.status_code,
        headers=exc.headers,
        media_type="application/json",
    )


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal error", path=request.url.path, error=describe(exc))
    return Response(
        error_body(500, f"internal error: {describe(exc)}"),
        status_code=500,
        media_type="application/json",
    )
