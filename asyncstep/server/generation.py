"""The generation requests of one server: admission, the engine requests
of each (one per prompt), its response whole or streamed, and the graceful
stop.

A request is admitted (:meth:`Generations.admit`) unless the engine is dead
or the server drains (503), or the batch's waiting queue would pass
``max_waiting_requests`` (429, ``Retry-After: 1``): the requests this
server has in flight past its share of the batch's capacity
(``max_num_running_reqs``, divided among ``api_server_count`` servers),
or, when the engine reports a queue (e.g. a full KV cache), that queue and
the new ones. Its response (:class:`GenerationResponse`) runs its prompts
(``Engine.stream``, each chunk to the response's formatter) while a task of
its own reads ``receive`` for the client's disconnect, which cancels it
(aborting its engine requests) up to its last send: that one is made outside
the cancellable scope, so that Hypercorn's own handling of the connection
after it (close, keep-alive) runs whole. A stream's headers go out with its
first chunk (a refused request is still an error status); an error after
that is a last ``data: {"error": ...}`` event, then ``[DONE]``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import cast

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from asyncstep.datatypes import Logprobs
from asyncstep.engine.front_end.data_parallel import DataParallelEngine, ServedEngine
from asyncstep.engine.messages.outputs import CompletionChunk
from asyncstep.errors import describe, leaves
from asyncstep.logging import get_logger
from asyncstep.server import sse
from asyncstep.server.config import ServerConfig
from asyncstep.server.errors import APIError, api_error
from asyncstep.server.metrics import RequestTimer, ServerMetrics
from asyncstep.server.requests import GenerationJob
from asyncstep.server.responses import ChoiceOutput, Formatter, usage

log = get_logger("server")

OnChunk = Callable[[int, CompletionChunk], Awaitable[None]]


@dataclass(frozen=True)
class Ending:
    """What ends a response: its last send (given the ASGI ``send``), made
    once the client's disconnect can no longer cancel it; and whether the
    request failed (it is then left out of the latency metrics)."""

    send: Callable[[Send], Awaitable[None]]
    failed: bool = False


@dataclass(frozen=True)
class InFlight:
    """A request being served: its engine request ids (one per prompt), and
    its client (the peer's address: the engine core shares grammar compiles
    fairly between clients; behind a proxy, every request is the proxy's)."""

    engine_ids: list[str]
    num_choices: int
    client: str = ""


class Generations:
    """The generation requests in flight of one server over one engine."""

    def __init__(self, engine: ServedEngine, metrics: ServerMetrics, config: ServerConfig) -> None:
        self.engine = engine
        self.metrics = metrics
        self.config = config
        #: Choices that may wait for a batch slot (None: no limit).
        self.waiting_limit = config.waiting_limit(self.batch_share)
        #: Requests being served, by response id.
        self.in_flight: dict[str, InFlight] = {}
        #: Refusing new requests (a graceful stop is under way).
        self.draining = False
        self._emptied: anyio.Event | None = None

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

    def check_serving(self) -> None:
        """503 once the engine is dead, or while draining."""
        if self.engine.error is not None:
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE, f"the engine stopped: {describe(self.engine.error)}"
            )
        if self.draining:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down")

    def admit(self, rid: str, job: GenerationJob, client: str = "") -> None:
        """Register a request, unless the server stops (503), its batch's
        waiting queue would pass the limit (429: by default a few times this
        server's share of the batch, see ``ServerConfig.waiting_limit``), or
        it asks for more choices than the share and the queue together could
        ever take (400)."""
        self.check_serving()
        limit = self.waiting_limit
        if limit is not None:
            most = self.batch_share + limit
            if job.num_choices > most:
                raise APIError(
                    HTTPStatus.BAD_REQUEST,
                    f"this request asks for {job.num_choices} choices (n x prompts); this server "
                    f"takes at most {most} at once ({self.batch_share} running + {limit} waiting: "
                    "max_waiting_requests)",
                    param="n",
                )
            waiting = self.projected_waiting(job.num_choices)
            if waiting > limit:
                raise APIError(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"too many requests waiting ({waiting} with this one; the limit is "
                    f"{limit}): retry later",
                    headers={"retry-after": "1"},
                )
        ids = [rid] if len(job.prompts) == 1 else [f"{rid}-p{i}" for i in range(len(job.prompts))]
        self.in_flight[rid] = InFlight(ids, job.num_choices, client)

    def projected_waiting(self, new_choices: int) -> int:
        """Requests that would wait for a batch slot with ``new_choices``
        more: those this server has in flight past the batch's capacity, or
        (when the engine reports a queue, e.g. the KV cache is full) its
        queue and these."""
        in_flight = sum(r.num_choices for r in self.in_flight.values())
        over = in_flight + new_choices - self.batch_share
        queued = self.engine.statistics().num_waiting_reqs
        return max(over, queued + new_choices if queued else 0)

    @property
    def batch_share(self) -> int:
        """This server's share of the batch's capacity (API servers of one
        engine core share it evenly; data-parallel replicas add theirs)."""
        capacity = self.engine.config.max_num_running_reqs
        if isinstance(self.engine, DataParallelEngine):
            capacity *= len(self.engine.engines)
        return -(-capacity // self.config.api_server_count)

    def release(self, rid: str) -> None:
        self.in_flight.pop(rid, None)
        if not self.in_flight and self._emptied is not None:
            self._emptied.set()

    async def respond(
        self,
        job: GenerationJob,
        fmt: Formatter,
        rid: str,
        receive: Receive,
        send: Send,
        client: str = "",
    ) -> None:
        """Serve one generation request (its response) for ``client`` (its
        address), until it ends or the client goes away.

        The client's disconnect cancels the work (the engine requests and
        every send but the last); the last send is made outside that scope:
        Hypercorn delivers the disconnect from inside it and then closes or
        recycles the connection there (``Connection: close``, HTTP/1.0, the
        keep-alive idle timeout), which a cancellation would cut short."""
        try:
            self.admit(rid, job, client)
        except APIError as exc:
            await send_error(send, exc)
            return
        timer = self.metrics.timer(job.num_choices)
        failed = False
        try:
            async with anyio.create_task_group() as tg:
                work = anyio.CancelScope()
                tg.start_soon(sse.watch_disconnect, receive, work)
                ending: Ending | None = None
                with work:
                    if job.stream:
                        ending = await self._stream(job, fmt, rid, timer, send)
                    else:
                        ending = await self._whole(job, fmt, rid, timer)
                if ending is not None and not work.cancel_called:
                    failed = ending.failed
                    await ending.send(send)
                tg.cancel_scope.cancel()
        finally:
            self.release(rid)
            if not failed:
                timer.end()

    async def _whole(
        self, job: GenerationJob, fmt: Formatter, rid: str, timer: RequestTimer
    ) -> Ending:
        """Run a request answered whole; its response is the ending."""
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
            return Ending(partial(send_error, error=self._failure(exc)), failed=True)
        completion_tokens = 0 if job.hide_output else sum(o.num_tokens for o in outputs)
        body = fmt.whole(outputs, usage(prompts.total, completion_tokens), prompt_logprobs)
        return Ending(partial(sse.send_whole, status=200, body=sse.encode(body)))

    async def _stream(
        self, job: GenerationJob, fmt: Formatter, rid: str, timer: RequestTimer, send: Send
    ) -> Ending:
        """Stream a request's events, the headers with the first chunk; the
        ending is its last events (or its error response, if it failed before
        the first chunk)."""
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
            body = fmt.chunk(index, chunk, first[index], now)
            if body is None:
                return  # nothing new: it goes with the next
            data = sse.event(body)
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
                return Ending(partial(send_error, error=error), failed=True)
            last = sse.event(error.body()) + sse.DONE
            return Ending(partial(sse.send_events, data=last, last=True))
        tail = sse.DONE
        if job.include_usage:
            tail = sse.event(fmt.usage_chunk(usage(prompts.total, completion_tokens))) + tail
        if not started:
            await sse.start_events(send)
        return Ending(partial(sse.send_events, data=tail, last=True))

    async def _generate(self, job: GenerationJob, rid: str, on_chunk: OnChunk) -> None:
        """Run every prompt of the request, each chunk to ``on_chunk``."""
        ids, client = self.in_flight[rid].engine_ids, self.in_flight[rid].client
        if len(ids) == 1:
            await self._run_prompt(job, 0, ids[0], client, on_chunk)
            return
        try:
            async with anyio.create_task_group() as tg:
                for i, engine_id in enumerate(ids):
                    tg.start_soon(self._run_prompt, job, i, engine_id, client, on_chunk)
        except BaseExceptionGroup as group:
            cancelled = anyio.get_cancelled_exc_class()
            found = leaves(group)
            if all(isinstance(e, (Exception, cancelled)) for e in found):
                errors = [e for e in found if isinstance(e, Exception)]
                if errors:
                    raise errors[0] from None
            raise

    async def _run_prompt(
        self, job: GenerationJob, i: int, engine_id: str, client: str, on_chunk: OnChunk
    ) -> None:
        stream = cast(
            AsyncGenerator[CompletionChunk, None],
            self.engine.stream(job.prompts[i], job.params[i], request_id=engine_id, client=client),
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
    the response is sent (:meth:`Generations.respond`)."""

    def __init__(
        self, generations: Generations, job: GenerationJob, fmt: Formatter, rid: str
    ) -> None:
        super().__init__(status_code=200)
        self.generations, self.job, self.fmt, self.rid = generations, job, fmt, rid

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        peer = scope.get("client")
        client = str(peer[0]) if peer else ""
        await self.generations.respond(self.job, self.fmt, self.rid, receive, send, client)


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


async def send_error(send: Send, error: APIError) -> None:
    headers = [*sse.JSON_HEADERS, *((k.encode(), v.encode()) for k, v in error.headers.items())]
    await sse.send_whole(send, error.status, error.body(), headers)
