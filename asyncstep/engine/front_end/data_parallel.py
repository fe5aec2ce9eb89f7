"""Data-parallel replicas behind one front end (``--data-parallel-size N``):
:class:`DataParallelEngine` and :func:`open_data_parallel_engine`.

Each replica is a whole :class:`~asyncstep.engine.front_end.engine.Engine`
(opened by :func:`~asyncstep.engine.front_end.api.open_engine`): an
engine-core process of its own with its own ranks (TP x PP), KV cache and
prefix cache, and its own output thread in this process. The replicas
start together; one failing to start fails the open.

Per request, after the prompt is checked and tokenized once here, the
:class:`~asyncstep.engine.front_end.dp_router.DataParallelRouter` picks a
live replica from each one's load (its requests in flight here, those its
core last reported running counted once, the rest as waiting) and, for
the ``prefix`` policy, the prompt's block hashes. The request is then the
replica's: its id (generated here, unique over the replicas, or the
caller's: refused while in flight on any replica) is recorded with it, so
:meth:`DataParallelEngine.abort` and a caller that goes away reach it.

A replica that dies fails only its own requests in flight, each with an
:class:`EngineDeadError` naming the replica; the router skips it from then
on and the others go on. :attr:`DataParallelEngine.error` is set, and the
engine stops, only once every replica has died. :meth:`DataParallelEngine.replicas`
says which live (``/health``); ``statistics()`` sums them (the prefix-cache
hit rate from the hit and query counts) and ``replica_statistics()`` gives
each one's.

Not here: MoE batch-shape coordination across replicas (the seed's
``coordinate_batch_across_dp``: the replicas' steps are independent, so
expert parallelism spans one replica's TP group only), attached API
servers (``--api-server-count`` > 1 with ``--data-parallel-size`` > 1 is
refused), and ``chat()`` on the engine (the server renders chats itself).
May import the front end's other modules, the engine core's block hash
(through the router), the messages and the errors.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import anyio
import msgspec

from asyncstep.config import EngineConfig
from asyncstep.datatypes import SamplingParams, WeightReads
from asyncstep.engine.front_end.dp_router import DataParallelRouter, replica_load
from asyncstep.engine.front_end.engine import Engine
from asyncstep.engine.front_end.input_processor import Prompt, check_request_id
from asyncstep.engine.front_end.statistics import EngineStatistics
from asyncstep.engine.messages.outputs import Completion, CompletionChunk
from asyncstep.errors import EngineDeadError, InvalidRequestError, describe, leaves
from asyncstep.logging import get_logger

if TYPE_CHECKING:
    from asyncstep.models.model_loader import ProgressFn

log = get_logger("engine")


class ReplicaHealth(msgspec.Struct, frozen=True):
    """One replica as ``/health`` tells it."""

    replica: int
    alive: bool
    error: str | None = None


class DataParallelEngine:
    """N engine replicas behind one front end (see the module doc); the
    methods of :class:`Engine` that serve requests, routed."""

    def __init__(self, config: EngineConfig, replicas: Sequence[Engine]) -> None:
        if not replicas:
            raise ValueError("a data-parallel engine needs a replica")
        self.config = config
        self.engines = list(replicas)
        first = self.engines[0]
        self.arch_config = first.arch_config
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        #: Checks and tokenizes each request at the door (the first replica's).
        self.input_processor = first.input_processor
        self.eos_token_ids = first.eos_token_ids
        parallel = config.parallel
        self.router = DataParallelRouter(
            len(self.engines),
            parallel.data_parallel_routing,
            block_size=config.cache.block_size,
            balance_threshold=parallel.data_parallel_balance_threshold,
        )
        #: Request id -> its replica, while in flight.
        self._owner: dict[str, int] = {}
        self._in_flight = [0] * len(self.engines)
        self._ids = itertools.count()

    # -- requests -----------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        client: str = "",
    ) -> Completion:
        """:meth:`Engine.generate` on the replica the router picks."""
        ids = await self.input_processor.encode_prompt(prompt)
        index, request_id = self._route(ids, request_id)
        try:
            with self._replica_errors(index):
                return await self.engines[index].generate(
                    _same_prompt(prompt, ids), sampling_params, request_id=request_id, client=client
                )
        finally:
            self._release(index, request_id)

    async def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        client: str = "",
    ) -> AsyncIterator[CompletionChunk]:
        """:meth:`Engine.stream` on the replica the router picks; leaving
        the iteration early aborts the request there."""
        ids = await self.input_processor.encode_prompt(prompt)
        index, request_id = self._route(ids, request_id)
        chunks = cast(
            AsyncGenerator[CompletionChunk, None],
            self.engines[index].stream(
                _same_prompt(prompt, ids), sampling_params, request_id=request_id, client=client
            ),
        )
        try:
            with self._replica_errors(index):
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
        finally:
            self._release(index, request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request in flight on whichever replica has it (no-op when
        it already ended)."""
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {type(request_id)}")
        index = self._owner.get(request_id)
        if index is not None:
            self.engines[index].abort(request_id)

    def replica_of(self, request_id: str) -> int | None:
        """The replica a request in flight went to."""
        return self._owner.get(request_id)

    async def encode_prompt(self, prompt: Prompt, **options: object) -> list[int]:
        """:meth:`Engine.encode_prompt` (the first replica's tokenizer)."""
        return await self.engines[0].encode_prompt(prompt, **options)  # type: ignore[arg-type]

    def encode_prompt_nowait(self, prompt: Prompt) -> list[int]:
        return self.input_processor.encode_prompt_nowait(prompt)

    def _route(self, ids: list[int], request_id: str | None) -> tuple[int, str]:
        """The replica for a request of prompt ``ids``, and its id; counted
        in flight there until :meth:`_release`."""
        request_id = self._check_request_id(request_id)
        alive = [engine.error is None for engine in self.engines]
        if not any(alive):
            raise EngineDeadError(f"every data-parallel replica died: {describe(self._errors())}")
        index = self.router.route(ids, self.loads(), alive)
        self._owner[request_id] = index
        self._in_flight[index] += 1
        return index, request_id

    def _release(self, index: int, request_id: str) -> None:
        self._in_flight[index] -= 1
        if self._owner.get(request_id) == index:
            del self._owner[request_id]

    def _check_request_id(self, request_id: object) -> str:
        if request_id is None:
            return f"req-{next(self._ids)}"
        request_id = check_request_id(request_id)
        if request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        return request_id

    @contextlib.contextmanager
    def _replica_errors(self, index: int) -> Iterator[None]:
        """A request's failure because its replica died, said so."""
        try:
            yield
        except EngineDeadError as exc:
            if self.engines[index].error is None:
                raise
            raise EngineDeadError(f"data-parallel replica {index} died: {exc}") from exc

    # -- state --------------------------------------------------------------

    def loads(self) -> list[int]:
        """Each replica's load, ``waiting * 4 + running`` (the router's)."""
        loads = []
        for engine, in_flight in zip(self.engines, self._in_flight, strict=True):
            running = min(engine.statistics().num_running_reqs, in_flight)
            loads.append(replica_load(in_flight - running, running))
        return loads

    def replicas(self) -> list[ReplicaHealth]:
        """Each replica, live or dead (and why)."""
        return [
            ReplicaHealth(i, e.error is None, None if e.error is None else describe(e.error))
            for i, e in enumerate(self.engines)
        ]

    def replica_statistics(self) -> list[EngineStatistics]:
        return [engine.statistics() for engine in self.engines]

    def statistics(self) -> EngineStatistics:
        """The replicas' counters summed (see :func:`summed_statistics`)."""
        return summed_statistics(self.replica_statistics())

    @property
    def error(self) -> BaseException | None:
        """Set once every replica has died."""
        if all(engine.error is not None for engine in self.engines):
            return self._errors()
        return None

    def _errors(self) -> EngineDeadError:
        why = "; ".join(
            f"replica {i}: {describe(e.error)}"
            for i, e in enumerate(self.engines)
            if e.error is not None
        )
        return EngineDeadError(f"every data-parallel replica died ({why})")

    @property
    def rank_pids(self) -> list[int]:
        return [pid for engine in self.engines for pid in engine.rank_pids]

    @property
    def weight_reads(self) -> WeightReads | None:
        return self.engines[0].weight_reads

    async def wait_idle(self) -> None:
        """:meth:`Engine.wait_idle` of every live replica."""
        for engine in self.engines:
            if engine.error is None:
                with contextlib.suppress(EngineDeadError):
                    await engine.wait_idle()
        if self.error is not None:
            raise EngineDeadError(describe(self.error))

    async def wait_stopped(self) -> None:
        """Wait until every replica has stopped (closed, or dead)."""
        for engine in self.engines:
            await engine.wait_stopped()

    async def aclose(self, timeout_s: float = 10.0) -> bool:
        """Close every replica (concurrently); False if one took longer."""
        done: list[bool] = []

        async def close(engine: Engine) -> None:
            done.append(await engine.aclose(timeout_s))

        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                tg.start_soon(close, engine)
        return all(done)


#: Either engine the server and the benchmarks serve through.
ServedEngine = Engine | DataParallelEngine


def summed_statistics(replicas: Sequence[EngineStatistics]) -> EngineStatistics:
    """Counters summed over replicas; the KV cache usage weighted by each
    one's blocks, the prefix-cache hit rate from the summed hits and queries."""
    first = replicas[0]
    blocks = sum(s.num_kv_blocks for s in replicas)
    queries = sum(s.prefix_cache_queries for s in replicas)
    hits = sum(s.prefix_cache_hits for s in replicas)
    return replace(
        first,
        num_running_reqs=sum(s.num_running_reqs for s in replicas),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in replicas),
        num_steps=sum(s.num_steps for s in replicas),
        num_preemptions=sum(s.num_preemptions for s in replicas),
        num_generated_tokens=sum(s.num_generated_tokens for s in replicas),
        num_finished_reqs=sum(s.num_finished_reqs for s in replicas),
        kv_cache_usage=(
            sum(s.kv_cache_usage * s.num_kv_blocks for s in replicas) / blocks if blocks else 0.0
        ),
        num_kv_blocks=blocks,
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in replicas),
        spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in replicas),
        spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in replicas),
        spec_decode_num_accepted_tokens_per_pos=_summed(
            [s.spec_decode_num_accepted_tokens_per_pos for s in replicas]
        ),
        moe_expert_tokens=_summed([s.moe_expert_tokens for s in replicas]),
    )


def _summed(rows: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    width = max((len(row) for row in rows), default=0)
    return tuple(sum(row[i] for row in rows if i < len(row)) for i in range(width))


def _same_prompt(prompt: Prompt, ids: list[int]) -> Prompt:
    """What the replica is given: the text (its completion keeps it), else the ids."""
    return prompt if isinstance(prompt, str) else ids


@asynccontextmanager
async def open_data_parallel_engine(
    config: EngineConfig, progress: ProgressFn | None = None
) -> AsyncIterator[DataParallelEngine]:
    """Start ``config.parallel.data_parallel_size`` replicas of ``config``
    together (``progress``: the first one's loading) and serve them as one
    :class:`DataParallelEngine`. Leaving the block closes them; it raises
    :class:`EngineDeadError` only if every replica died."""
    from asyncstep.engine.front_end.api import open_engine

    size = config.parallel.data_parallel_size
    engines: list[Engine | None] = [None] * size
    started = anyio.Event()
    stop = anyio.Event()
    failures: list[BaseException] = []

    async def replica(index: int) -> None:
        own = copy.deepcopy(config)
        own.parallel.data_parallel_rank = index
        try:
            async with open_engine(config=own, progress=progress if index == 0 else None) as engine:
                engines[index] = engine
                if all(e is not None for e in engines):
                    started.set()
                await stop.wait()
        except EngineDeadError as exc:
            if not stop.is_set():
                raise  # it failed to start
            failures.append(exc)  # it died serving: its requests were told
            log.warning("data-parallel replica ended dead", replica=index, error=describe(exc))

    async def watch(index: int, engine: Engine) -> None:
        await engine.wait_stopped()
        if engine.error is not None and not stop.is_set():
            log.error(
                "a data-parallel replica died: its requests failed, the others go on",
                replica=index,
                error=describe(engine.error),
            )

    try:
        async with anyio.create_task_group() as tg:
            for index in range(size):
                tg.start_soon(replica, index)
            await started.wait()
            served = DataParallelEngine(config, [e for e in engines if e is not None])
            for index, engine in enumerate(served.engines):
                tg.start_soon(watch, index, engine)
            try:
                yield served
            finally:
                stop.set()
    except BaseExceptionGroup as group:
        # The caller's error, or a replica's that failed to start (the
        # replicas of one config fail alike: the first says why).
        error = group.exceptions[0] if len(group.exceptions) == 1 else leaves(group)[0]
        raise error from error.__cause__
    if len(failures) == size:
        raise EngineDeadError(f"the engine stopped: {describe(failures[0])}")
