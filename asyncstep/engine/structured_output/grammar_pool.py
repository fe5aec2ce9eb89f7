"""The engine core's grammar compiles: a pool of worker processes that can be
killed, a queue fair between clients, a time and a memory limit per compile,
and cancellation when no request waits any more.

A grammar's compile is a :class:`CompileJob`, shared by every request that
waits for the same grammar (:meth:`CompilePool.compile`). Jobs wait in a
:class:`~asyncstep.engine.structured_output.fair_queue.FairQueue` keyed by the client of the
request that asked first, and are taken by ``grammar_compile_workers``
slots, each with one worker process (:mod:`asyncstep.engine.structured_output.grammar_worker`,
started when its slot takes its first job: xgrammar's import takes
seconds). A slot sends the grammar to its worker and watches it (its
CPU time and resident memory, read from ``/proc`` every :data:`POLL_S`):
past ``grammar_compile_timeout_s`` of CPU time (a compile's cost, whatever
else the machine runs; and at most ``WALL_TIME_FACTOR`` times that of
waiting), once its memory grew by more than ``grammar_compile_memory_mib``,
or when the last request waiting for the job went away, the worker is
killed (SIGKILL: xgrammar's C++ cannot be stopped otherwise) and the slot
starts a fresh one for its next job. A grammar the worker compiled within
the limits is then built by the pool's ``build`` (the engine core's own
compile, in a thread of low priority: see
:mod:`asyncstep.engine.structured_output.manager`), still in the slot, so at most
one build per slot runs at a time and each is known to be within the
limits; a build cannot be stopped, so a job whose requests went away during
its build ends when the build does. A worker holds xgrammar (and through it
torch and transformers) and the vocabulary: one that waited
``grammar_compile_idle_s`` for a job is stopped, and its slot starts a fresh
one for the next (a grammar in the core's cache needs none).

A "client" is whatever key the requests carry (the engine core uses the
front end that added the request and the caller's client key, e.g. an HTTP
client's address: :class:`~asyncstep.engine.messages.core_messages.EngineCoreRequest`).

Workers die with the engine core: each one's stdin is a pipe from the core,
and it exits when that closes (see :mod:`asyncstep.procs`). Imports anyio,
the framing and the worker's messages.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from traceback import format_exc
from typing import Any

import anyio
import anyio.abc

from asyncstep.channels.framing import MessageStream
from asyncstep.config import StructuredOutputsConfig
from asyncstep.engine.structured_output.fair_queue import FairQueue
from asyncstep.engine.structured_output.grammar_cache import GrammarKey
from asyncstep.engine.structured_output.grammar_messages import (
    CompileGrammar,
    FromWorker,
    GrammarCompiled,
    GrammarRefused,
    WorkerReady,
    WorkerSetup,
)
from asyncstep.errors import InvalidRequestError, describe
from asyncstep.logging import get_logger
from asyncstep.procs import exit_reason

log = get_logger("engine")

#: How often a compiling worker's memory and CPU time are read.
POLL_S = 0.02
#: A compile may wait this many times its CPU time limit, in all (a busy
#: machine, or the worker's low priority, slows it without its fault).
WALL_TIME_FACTOR = 10
#: Longest a worker may take to start (import xgrammar, read the vocabulary).
WORKER_START_TIMEOUT_S = 120.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(eq=False)
class CompileJob:
    """One grammar's compile and the requests waiting for it."""

    key: GrammarKey
    client: Hashable
    #: A token per request waiting for it.
    waiters: set[object] = field(default_factory=set)
    #: Set while a slot runs it (cancelling it kills its worker).
    scope: anyio.CancelScope | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    #: The compiled grammar (``build``'s), or why it was refused.
    result: Any = None
    error: str | None = None


@dataclass
class CompilePoolStats:
    num_compiled: int = 0
    #: Grammars that do not compile, or over a limit (the next three).
    num_refused: int = 0
    num_timed_out: int = 0
    num_over_memory: int = 0
    num_worker_deaths: int = 0
    #: Jobs dropped because no request waited for them any more.
    num_cancelled: int = 0
    num_workers_started: int = 0
    num_workers_killed: int = 0
    #: Workers stopped after ``grammar_compile_idle_s`` without a job.
    num_workers_idle: int = 0


class CompileLimitError(InvalidRequestError):
    """A compile went past a limit, or its worker died: the worker must go.
    ``reason``: ``"time"``, ``"memory"`` or ``"died"``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class GrammarWorker:
    """One compile worker process and its connection (see the module doc)."""

    def __init__(self, process: anyio.abc.Process, channel: MessageStream[FromWorker]) -> None:
        self.process = process
        self.channel = channel
        #: Resident bytes once ready (what each compile's growth is measured from).
        self.idle_rss = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(
        cls, vocabulary: Callable[[], Awaitable[str]], max_threads: int
    ) -> GrammarWorker:
        """Start a worker and set it up with ``vocabulary()`` (awaited while
        the worker imports xgrammar); killed again if that fails."""
        ours, theirs = socket.socketpair()
        try:
            process = await anyio.open_process(
                [
                    sys.executable,
                    "-m",
                    "asyncstep.engine.structured_output.grammar_worker",
                    "--fd",
                    str(theirs.fileno()),
                ],
                stdin=subprocess.PIPE,  # never written: its end tells the worker the core died
                stdout=None,
                stderr=None,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        stream = await anyio.abc.SocketStream.from_socket(ours)
        worker = cls(process, MessageStream[FromWorker](stream, FromWorker))
        try:
            with anyio.fail_after(WORKER_START_TIMEOUT_S):
                await worker.channel.send(WorkerSetup(await vocabulary(), max_threads))
                ready = await worker._receive()
            if not isinstance(ready, WorkerReady):
                raise RuntimeError(f"the grammar worker sent {type(ready).__name__} first")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await worker.aclose()
            raise
        worker.idle_rss = worker.rss()
        log.info("grammar compile worker started", pid=process.pid)
        return worker

    def rss(self) -> int:
        """The worker's resident bytes (0 once it is gone)."""
        try:
            with open(f"/proc/{self.pid}/statm", "rb") as statm:
                return int(statm.read().split()[1]) * _PAGE_BYTES
        except (OSError, IndexError, ValueError):
            return 0

    def cpu_s(self) -> float:
        """The CPU seconds the worker used, all its threads (0 once it is gone)."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime
        except (OSError, IndexError, ValueError):
            return 0.0

    async def compile(
        self, key: GrammarKey, *, timeout_s: float, max_growth: int
    ) -> GrammarCompiled | GrammarRefused:
        """Compile ``key`` in the worker, within ``timeout_s`` seconds of CPU
        time (and ``WALL_TIME_FACTOR`` times that of waiting) and ``max_growth``
        more resident bytes than before; past either, or if the worker dies,
        :class:`CompileLimitError` (the worker must then be killed: it may
        still be compiling)."""
        what = f"structured_outputs.{key.kind}"
        outcome: FromWorker | CompileLimitError | None = None
        try:
            await self.channel.send(CompileGrammar(key.kind, key.spec))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            raise await self._died(what) from None
        wall_s = WALL_TIME_FACTOR * timeout_s
        with anyio.move_on_after(wall_s):
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    nonlocal outcome
                    outcome = await self._watch(what, timeout_s, max_growth)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                try:
                    outcome = await self._receive(what)
                except CompileLimitError as exc:  # raised here, not in the task group
                    outcome = exc
                tg.cancel_scope.cancel()
        if outcome is None:
            raise CompileLimitError(
                f"{what}: its grammar did not compile within {wall_s:g} s "
                f"({WALL_TIME_FACTOR} x grammar_compile_timeout_s: the machine is busy)",
                "time",
            )
        if isinstance(outcome, CompileLimitError):
            raise outcome
        if not isinstance(outcome, GrammarCompiled | GrammarRefused):
            raise CompileLimitError(f"{what}: the worker sent {type(outcome).__name__}", "died")
        return outcome

    async def _watch(self, what: str, timeout_s: float, max_growth: int) -> CompileLimitError:
        """Read the worker's memory and CPU time until the compile passes a
        limit: the error that says which."""
        base_rss, base_cpu_s = self.rss(), self.cpu_s()
        while True:
            if self.rss() - base_rss > max_growth:
                return CompileLimitError(
                    f"{what}: its grammar took more than {max_growth >> 20} MiB to compile "
                    "(grammar_compile_memory_mib)",
                    "memory",
                )
            if self.cpu_s() - base_cpu_s > timeout_s:
                return CompileLimitError(
                    f"{what}: its grammar did not compile within {timeout_s:g} s of CPU time "
                    "(grammar_compile_timeout_s)",
                    "time",
                )
            await anyio.sleep(POLL_S)  # another process: nothing to wait on but time

    async def _receive(self, what: str = "the grammar worker") -> FromWorker:
        try:
            return await self.channel.receive()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
            raise await self._died(what) from None

    async def _died(self, what: str) -> CompileLimitError:
        """The error of a worker whose connection broke (how it ended, if it did)."""
        with anyio.move_on_after(2):
            code = await self.process.wait()
            return CompileLimitError(
                f"{what}: the grammar compile worker {exit_reason(code)}", "died"
            )
        return CompileLimitError(
            f"{what}: the grammar compile worker closed its connection", "died"
        )

    def kill(self) -> None:
        """Kill the process now (it may be in the middle of a compile)."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def aclose(self) -> None:
        """Kill the process and reap it; close the connection."""
        self.kill()
        with anyio.move_on_after(10):
            await self.process.wait()
        with contextlib.suppress(Exception):
            await self.channel.aclose()
        await self.process.aclose()


class CompilePool:
    """The grammar compiles of one engine core (see the module doc).

    ``vocabulary()`` gives xgrammar's ``TokenizerInfo.serialize_json()``
    (awaited at each worker start); ``build(key)`` is the engine core's own
    compile of a grammar its worker compiled within the limits (it may keep
    it in a cache); its result goes to every request waiting."""

    def __init__(
        self,
        config: StructuredOutputsConfig,
        *,
        vocabulary: Callable[[], Awaitable[str]],
        build: Callable[[GrammarKey], Awaitable[Any]],
        max_threads: int = 1,
    ) -> None:
        self.config = config
        self._vocabulary = vocabulary
        self._build = build
        self.max_threads = max_threads
        self._queue: FairQueue[CompileJob] = FairQueue()
        #: Jobs queued or running, by the digest of their grammar.
        self._jobs: dict[bytes, CompileJob] = {}
        self._workers: list[GrammarWorker | None] = [None] * config.grammar_compile_workers
        self._stats = CompilePoolStats()

    def statistics(self) -> CompilePoolStats:
        return CompilePoolStats(**vars(self._stats))

    @property
    def worker_pids(self) -> list[int]:
        """The worker processes alive now."""
        return [w.pid for w in self._workers if w is not None]

    @property
    def num_jobs(self) -> int:
        """Jobs queued or running (for a request still waiting)."""
        return len(self._jobs)

    @property
    def num_waiting(self) -> int:
        """Requests waiting for a job."""
        return sum(len(job.waiters) for job in self._jobs.values())

    @property
    def num_running(self) -> int:
        """Jobs a slot runs now (for a request still waiting)."""
        return sum(job.scope is not None for job in self._jobs.values())

    async def run(self) -> None:
        """Serve the queue until cancelled (jobs queue until then); then
        kill every worker."""
        try:
            async with anyio.create_task_group() as tg:
                for slot in range(len(self._workers)):
                    tg.start_soon(self._serve, slot)
        finally:
            with anyio.CancelScope(shield=True):
                for slot, worker in enumerate(self._workers):
                    self._workers[slot] = None
                    if worker is not None:
                        await worker.aclose()

    def kill_all(self) -> None:
        """Kill every worker now (for a core that stops without its loop)."""
        for worker in self._workers:
            if worker is not None:
                worker.kill()

    async def compile(self, key: GrammarKey, client: Hashable) -> Any:
        """The grammar of ``key``, built once its worker compiled it within
        the limits; :class:`InvalidRequestError` (one line) if it does not
        compile or goes past a limit. Joins the job of the same grammar if
        one is queued or running; a waiter cancelled is one fewer, and the
        last one gone drops the job (its worker killed, if it runs)."""
        job = self._jobs.get(key.digest)
        if job is None:
            job = self._jobs[key.digest] = CompileJob(key, client)
            self._queue.put(client, job)
        waiter = object()
        job.waiters.add(waiter)
        try:
            await job.done.wait()
        finally:
            job.waiters.discard(waiter)
            if not job.waiters and not job.done.is_set():
                self._drop(job)
        if job.error is not None:
            raise InvalidRequestError(job.error)
        return job.result

    def _drop(self, job: CompileJob) -> None:
        """No request waits for ``job`` any more: withdraw it, or cancel its
        run (which kills its worker)."""
        if self._jobs.get(job.key.digest) is job:
            del self._jobs[job.key.digest]  # a new request for it starts afresh
        self._stats.num_cancelled += 1
        if self._queue.remove(job.client, job):
            job.done.set()
        elif job.scope is not None:
            job.scope.cancel()

    async def _serve(self, slot: int) -> None:
        while True:
            client, job = await self._next_job(slot)
            job.error = "the engine core stopped"  # unless the job ends
            try:
                with anyio.CancelScope() as job.scope:
                    try:
                        job.result = await self._run(slot, job)
                        job.error = None
                        self._stats.num_compiled += 1
                    except InvalidRequestError as exc:
                        job.error = str(exc)
                        self._stats.num_refused += 1
                    except Exception as exc:  # a fault of ours: this job fails, the pool serves on
                        why = " ".join(describe(exc).split())
                        log.error("grammar compile failed", error=why, traceback=format_exc())
                        job.error = f"structured_outputs.{job.key.kind}: its compile failed ({why})"
                if job.scope.cancelled_caught:
                    job.error = f"structured_outputs.{job.key.kind}: its compile was cancelled"
            finally:
                self._queue.done(client)
                if self._jobs.get(job.key.digest) is job:
                    del self._jobs[job.key.digest]
                job.done.set()

    async def _next_job(self, slot: int) -> tuple[Hashable, CompileJob]:
        """The slot's next job; its worker is stopped once it waited
        ``grammar_compile_idle_s`` for one."""
        worker = self._workers[slot]
        if worker is not None:
            with anyio.move_on_after(self.config.grammar_compile_idle_s):
                return await self._queue.get()
            with anyio.CancelScope(shield=True):
                await worker.aclose()
            self._workers[slot] = None
            self._stats.num_workers_idle += 1
            log.info("grammar compile worker stopped, idle", pid=worker.pid)
        return await self._queue.get()

    async def _run(self, slot: int, job: CompileJob) -> Any:
        """Compile ``job`` in the slot's worker (started if need be), then build it."""
        worker = self._workers[slot]
        if worker is None:
            worker = await self._start_worker(job)
            self._workers[slot] = worker
        config = self.config
        max_growth = config.grammar_compile_memory_mib << 20
        try:
            answer = await worker.compile(
                job.key, timeout_s=config.grammar_compile_timeout_s, max_growth=max_growth
            )
        except BaseException as exc:  # past a limit, dead, or cancelled: it may still compile
            await self._retire(slot, worker, exc)
            raise
        if worker.rss() - worker.idle_rss > max_growth:
            await self._retire(slot, worker)  # it kept memory: a fresh one next time
        if isinstance(answer, GrammarRefused):
            raise InvalidRequestError(answer.error)
        return await self._build(job.key)

    async def _start_worker(self, job: CompileJob) -> GrammarWorker:
        try:
            worker = await GrammarWorker.start(self._vocabulary, self.max_threads)
        except InvalidRequestError:
            raise  # e.g. a model without a tokenizer
        except (OSError, RuntimeError, TimeoutError) as exc:
            log.error("grammar compile worker did not start", error=str(exc))
            raise InvalidRequestError(
                f"structured_outputs.{job.key.kind}: the grammar compile worker did not "
                f"start ({exc})"
            ) from None
        self._stats.num_workers_started += 1
        return worker

    async def _retire(
        self, slot: int, worker: GrammarWorker, why: BaseException | None = None
    ) -> None:
        """Kill the slot's worker (the slot starts another for its next job)."""
        self._workers[slot] = None
        stats = self._stats
        stats.num_workers_killed += 1
        if isinstance(why, CompileLimitError):
            log.warning("grammar compile stopped", error=str(why), pid=worker.pid)
            if why.reason == "time":
                stats.num_timed_out += 1
            elif why.reason == "memory":
                stats.num_over_memory += 1
            else:
                stats.num_worker_deaths += 1
        with anyio.CancelScope(shield=True):
            await worker.aclose()
