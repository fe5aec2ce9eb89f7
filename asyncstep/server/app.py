"""The OpenAI-compatible routes over one :class:`~asyncstep.engine.engine.Engine`.

:func:`build_app` gives a Starlette app (on AnyIO: it runs under Trio or
asyncio, alone or mounted in a service's own ASGI app):

* ``POST /v1/completions``, ``POST /v1/chat/completions``: whole, or
  streamed as server-sent events (``stream_options.include_usage``: a last
  chunk with the usage);
* ``GET /v1/models``; ``GET /health`` (503 once the engine is dead or the
  server drains); ``GET /metrics`` (:mod:`asyncstep.server.metrics`);
  ``POST /tokenize``, ``POST /detokenize``; ``GET /version``.

A request is read (at most ``max_request_body_bytes``: else 413), decoded
(a bad body or field: 400), matched to a served model name (else 404),
turned into engine requests (:mod:`asyncstep.server.requests`: what the
engine refuses is a 400), and admitted unless the batch's waiting queue
would pass ``max_waiting_requests`` (429, with ``Retry-After``). Errors
have OpenAI's JSON shape (:mod:`asyncstep.server.errors`).

Every response of a generation watches for its client's disconnect while
it runs: a client that goes away cancels it, which aborts its engine
requests (their KV blocks are freed at once). A stream's headers are sent
with its first chunk, so that a request the engine refuses is still a 400;
an error after that is a last ``data: {"error": ...}`` event, then
``[DONE]``.

:meth:`OpenAIServer.drain` is the graceful stop: new requests get 503,
those in flight may finish for a while, then are aborted (they end with
finish reason ``abort``).
"""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from asyncstep.datatypes import Logprobs
from asyncstep.engine.engine import Engine
from asyncstep.engine.outputs import CompletionChunk
from asyncstep.errors import InvalidRequestError, describe, leaves
from asyncstep.logging import get_logger
from asyncstep.server import sse
from asyncstep.server.config import ServerConfig
from asyncstep.server.errors import APIError, api_error, bad_request, error_body
from asyncstep.server.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
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
    ChoiceOutput,
    CompletionFormatter,
    Formatter,
    TokenTexts,
    usage,
)

log = get_logger("server")

#: The embedded model's name in the API (when ``--model`` is not given).
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
#: How long ``/metrics`` waits for the engine's counters when idle.
METRICS_REFRESH_S = 0.5

OnChunk = Callable[[int, CompletionChunk], Awaitable[None]]


def build_app(engine: Engine, config: ServerConfig | None = None) -> Starlette:
    """The OpenAI-compatible app over ``engine`` (its :class:`OpenAIServer`
    is ``app.state.openai_server``)."""
    return OpenAIServer(engine, config).app


def default_model_name(engine: Engine) -> str:
    return engine.config.model.model or EMBEDDED_MODEL_NAME


@dataclass(frozen=True)
class InFlight:
    """A request being served: its engine request ids (one per prompt)."""

    engine_ids: list[str]
    num_choices: int


class OpenAIServer:
    """The routes and the state of one server over one engine."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.model_names = list(self.config.served_model_name or [default_model_name(engine)])
        self.model_name = self.model_names[0]
        self.metrics = ServerMetrics(engine, self.model_name)
        self.texts = TokenTexts(engine.tokenizer)
        #: Requests being served, by response id.
        self.in_flight: dict[str, InFlight] = {}
        #: Refusing new requests (a graceful stop is under way).
        self.draining = False
        self._emptied: anyio.Event | None = None
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
        self.app.state.openai_server = self

    # -- graceful stop ------------------------------------------------------

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait up to ``timeout_s`` for those in
        flight, then abort what is left (responses end with ``abort``)."""
        self.draining = True
        with anyio.move_on_after(timeout_s):
            while self.in_flight:
                self._emptied = anyio.Event()
                await self._emptied.wait()
        self.abort_all()

    def abort_all(self) -> None:
        for request in list(self.in_flight.values()):
            for engine_id in request.engine_ids:
                self.engine.abort(engine_id)

    # -- routes ---------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = decode_body(await self._body(request), CompletionRequest)
        self._check_model(body.model)
        job = completion_job(self.engine, body)
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
        return GenerationResponse(self, job, fmt, rid)

    async def chat_completions(self, request: Request) -> Response:
        body = decode_body(await self._body(request), ChatCompletionRequest)
        self._check_model(body.model)
        job = chat_job(self.engine, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormatter(
            rid,
            int(time.time()),
            self.model_name,
            self.texts,
            job.logprobs is not None,
            job.prompt_logprobs,
        )
        return GenerationResponse(self, job, fmt, rid)

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
        self._check_serving()
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
            tokens = self.engine.encode_prompt(chat_messages(body.messages))
        else:
            tokenizer = self._tokenizer()
            tokens = list(
                tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
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
        declared length first, then as it arrives)."""
        limit = self.config.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request(f"bad content-length header {declared!r}")
            if int(declared) > limit:
                raise _too_large(int(declared), limit)
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise _too_large(size, limit)
            parts.append(part)
        return b"".join(parts)

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"the model {name!r} does not exist (this server serves {served})",
                param="model",
            )

    def _check_serving(self) -> None:
        if self.engine.error is not None:
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE, f"the engine stopped: {describe(self.engine.error)}"
            )
        if self.draining:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")

    def _admit(self, rid: str, job: GenerationJob) -> None:
        """Register a request, unless the server stops or its batch's
        waiting queue would pass the limit."""
        self._check_serving()
        limit = self.config.max_waiting_requests
        if limit is not None:
            waiting = self.projected_waiting(job.num_choices)
            if waiting > limit:
                raise APIError(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"too many requests waiting ({waiting} with this one; the limit is "
                    f"{limit}): retry later",
                    headers={"retry-after": "1"},
                )
        ids = [rid] if len(job.prompts) == 1 else [f"{rid}-p{i}" for i in range(len(job.prompts))]
        self.in_flight[rid] = InFlight(ids, job.num_choices)

    def projected_waiting(self, new_choices: int) -> int:
        """Requests that would wait for a batch slot with ``new_choices``
        more: those this server has in flight past the batch's capacity, or
        (when the engine reports a queue, e.g. the KV cache is full) its
        queue and these."""
        in_flight = sum(r.num_choices for r in self.in_flight.values())
        over = in_flight + new_choices - self.engine.config.max_num_running_reqs
        queued = self.engine.statistics().num_waiting_reqs
        return max(over, queued + new_choices if queued else 0)

    def _release(self, rid: str) -> None:
        self.in_flight.pop(rid, None)
        if not self.in_flight and self._emptied is not None:
            self._emptied.set()

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

    # -- generation -----------------------------------------------------------

    async def respond(
        self, job: GenerationJob, fmt: Formatter, rid: str, receive: Receive, send: Send
    ) -> None:
        """Serve one generation request (its response), until it ends or
        its client goes away."""
        try:
            self._admit(rid, job)
        except APIError as exc:
            await _send_error(send, exc)
            return
        timer = self.metrics.timer(job.num_choices)
        failed = False
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(sse.watch_disconnect, receive, tg.cancel_scope)
                try:
                    if job.stream:
                        failed = await self._stream(job, fmt, rid, timer, send)
                    else:
                        failed = await self._whole(job, fmt, rid, timer, send)
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self._release(rid)
            if not failed:
                timer.end()

    async def _whole(
        self, job: GenerationJob, fmt: Formatter, rid: str, timer: RequestTimer, send: Send
    ) -> bool:
        """A whole response; True if the request failed."""
        outputs = [ChoiceOutput() for _ in range(job.num_choices)]
        prompts = _PromptTokens(self.metrics, job)
        prompt_logprobs: list[list[Logprobs | None] | None] = [None] * len(job.prompts)

        async def on_chunk(i: int, chunk: CompletionChunk) -> None:
            index = i * job.n + chunk.index
            prompts.seen(i)
            timer.chunk(index, len(chunk.token_ids), _reason(chunk))
            outputs[index].add(chunk)
            if chunk.prompt_logprobs is not None:
                prompt_logprobs[i] = chunk.prompt_logprobs

        try:
            await self._generate(job, rid, on_chunk)
        except Exception as exc:
            await _send_error(send, self._failure(exc))
            return True
        completion_tokens = 0 if job.hide_output else sum(o.num_tokens for o in outputs)
        body = fmt.whole(outputs, usage(prompts.total, completion_tokens), prompt_logprobs)
        await sse.send_whole(send, 200, sse.encode(body))
        return False

    async def _stream(
        self, job: GenerationJob, fmt: Formatter, rid: str, timer: RequestTimer, send: Send
    ) -> bool:
        """An event stream, its headers sent with the first chunk; True if
        the request failed before it."""
        started = False
        first = [True] * job.num_choices
        prompts = _PromptTokens(self.metrics, job)
        completion_tokens = 0
        lock = anyio.Lock() if len(job.prompts) > 1 else None

        async def on_chunk(i: int, chunk: CompletionChunk) -> None:
            nonlocal started, completion_tokens
            index = i * job.n + chunk.index
            prompts.seen(i)
            timer.chunk(index, len(chunk.token_ids), _reason(chunk))
            if not job.hide_output:
                completion_tokens += len(chunk.token_ids)
            now = usage(prompts.total, completion_tokens) if job.continuous_usage else None
            data = sse.event(fmt.chunk(index, chunk, first[index], now))
            first[index] = False
            async with lock if lock is not None else contextlib.nullcontext():
                if not started:
                    started = True
                    await sse.start_events(send)
                await sse.send_events(send, data)

        try:
            await self._generate(job, rid, on_chunk)
        except Exception as exc:
            error = self._failure(exc)
            if not started:
                await _send_error(send, error)
                return True
            await sse.send_events(send, sse.event(error.body()) + sse.DONE, last=True)
            return False
        tail = sse.DONE
        if job.include_usage:
            tail = sse.event(fmt.usage_chunk(usage(prompts.total, completion_tokens))) + tail
        if not started:
            await sse.start_events(send)
        await sse.send_events(send, tail, last=True)
        return False

    async def _generate(self, job: GenerationJob, rid: str, on_chunk: OnChunk) -> None:
        """Run every prompt of the request, each chunk to ``on_chunk``."""
        ids = self.in_flight[rid].engine_ids
        if len(ids) == 1:
            await self._run_prompt(job, 0, ids[0], on_chunk)
            return
        try:
            async with anyio.create_task_group() as tg:
                for i, engine_id in enumerate(ids):
                    tg.start_soon(self._run_prompt, job, i, engine_id, on_chunk)
        except BaseExceptionGroup as group:
            cancelled = anyio.get_cancelled_exc_class()
            found = leaves(group)
            if all(isinstance(e, (Exception, cancelled)) for e in found):
                errors = [e for e in found if isinstance(e, Exception)]
                if errors:
                    raise errors[0] from None
            raise

    async def _run_prompt(
        self, job: GenerationJob, i: int, engine_id: str, on_chunk: OnChunk
    ) -> None:
        stream = cast(
            AsyncGenerator[CompletionChunk, None],
            self.engine.stream(job.prompts[i], job.params[i], request_id=engine_id),
        )
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                await on_chunk(i, chunk)

    def _failure(self, error: Exception) -> APIError:
        failure = api_error(error)
        if failure.status >= 500:
            log.error("request failed", status=failure.status, error=describe(error))
        return failure


class GenerationResponse(Response):
    """The response of a generation request: the request is served when
    the response is sent (:meth:`OpenAIServer.respond`)."""

    def __init__(self, server: OpenAIServer, job: GenerationJob, fmt: Formatter, rid: str) -> None:
        super().__init__(status_code=200)
        self.server, self.job, self.fmt, self.rid = server, job, fmt, rid

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.server.respond(self.job, self.fmt, self.rid, receive, send)


class _PromptTokens:
    """Counts each prompt's tokens in the metrics once it is admitted (its
    first chunk: its prefill is done)."""

    def __init__(self, metrics: ServerMetrics, job: GenerationJob) -> None:
        self.metrics = metrics
        self.lengths = [len(p) for p in job.prompts]
        self.total = sum(self.lengths)
        self._seen = [False] * len(self.lengths)

    def seen(self, i: int) -> None:
        if not self._seen[i]:
            self._seen[i] = True
            self.metrics.prompt_tokens.inc(self.lengths[i])


def _reason(chunk: CompletionChunk) -> str | None:
    return None if chunk.finish_reason is None else str(chunk.finish_reason)


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


async def _send_error(send: Send, error: APIError) -> None:
    headers = [*sse.JSON_HEADERS, *((k.encode(), v.encode()) for k, v in error.headers.items())]
    await sse.send_whole(send, error.status, error.body(), headers)


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
