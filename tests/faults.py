"""The fault campaign of issue 14 ("no request can kill the engine"): a
check of correctness under faults, not a measurement, so it lives with the
tests (``tests/engine/test_faults.py`` runs it at CI's size; run it whole from
here).

Three campaigns, each a subcommand:

* ``kill-core``: ``--rounds`` times, open an engine (its core in a process
  of its own), put ``--callers`` concurrent requests on it (half streams,
  half ``generate`` calls, long enough not to end), SIGKILL the engine-core
  process a random time (``--max-delay``) after every stream has its first
  token, and start one more request right after the kill (the *late*
  caller). Every caller must get :class:`~asyncstep.EngineDeadError` within
  ``--deadline`` seconds of the kill (10), leaving the ``open_engine`` block
  must raise it too, and every process the engine started (the core, its
  ranks) must be gone. Measured: each caller's time from the kill to its
  error (p50, max), the block's exit, the last process's end.
* ``kill-rank``: the same with ``--tp`` x ``--pp`` rank processes (2 x 1 by
  default: gloo on the CPU), killing one rank (``--rank``, else rank ``round % ranks``).
* ``aborts``: ``--aborts`` requests (*victims*) each aborted one of five
  ways: a cancel scope around ``stream`` cancelled after k tokens
  (``cancel_stream``), a cancel scope around ``generate`` with a random
  deadline (``cancel_generate``), an early ``break`` out of ``stream``
  (``break_stream``), ``engine.abort(request_id)`` from the stream's reader
  after k tokens (``abort_stream``) or from another task against a
  ``generate`` (``abort_generate``), on a KV cache small enough that the
  scheduler preempts (4-token blocks, 24 of them). Meanwhile *survivor*
  requests (greedy) run to their end; each must give the tokens it gives in a
  run alone (a roomy engine, one request at a time). Some victims share a
  survivor's prompt prefix (prefix-cache hits on blocks that aborted requests
  freed). At the end, once idle, every KV block must be back (with the core
  in this process, ``--no-engine-process``: every block's reference count 0
  and no request left in the scheduler), and the engine must still serve.
  Deadlines are random wall-clock times (``--clock wall``) or token counts
  read by the campaign's streams (``--clock tokens``: no timers; what the
  tests use).

Each run prints a table and writes JSON (``--out``, default under
``benchmarks/results/faults/``) and the table next to it (``.txt``), both
headed by the command line, the machine and the date. Exit status 1 when a
check failed. On this CPU machine::

    python3 tests/faults.py kill-core --rounds 5 --callers 32
    python3 tests/faults.py kill-rank --rounds 3 --callers 16
    python3 tests/faults.py aborts --aborts 1000

On a GPU the same commands run on CUDA (``--device auto``); ``--model``
takes a shape name (dummy weights), a GGUF file or an HF directory.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import torch
import trio

import asyncstep
from asyncstep import EngineDeadError, FinishReason, SamplingParams
from asyncstep.engine.core.engine_core import EngineCore
from asyncstep.engine.transport.core_client import CoreProcess
from asyncstep.errors import describe
from asyncstep.models.dummy import SHAPES

try:  # optional: without it, processes are read from /proc
    import psutil  # type: ignore[import-untyped]
except ImportError:
    psutil = None

RESULTS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "faults"
KINDS = ("cancel_stream", "cancel_generate", "break_stream", "abort_stream", "abort_generate")
#: Every caller must see EngineDeadError this soon after a kill (issue 14).
DEADLINE_S = 10.0


# -- processes ----------------------------------------------------------------


class Proc(msgspec.Struct, frozen=True):
    """A process, told apart from a later one of the same pid by its start time."""

    pid: int
    start: float


def _proc_stat(pid: int) -> tuple[str, int, float] | None:
    """(state, parent pid, start time in clock ticks) from /proc, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1]), float(fields[19])


def descendants(root: int | None = None) -> list[Proc]:
    """Every live process below ``root`` (this process), through psutil when
    it is installed, else from /proc."""
    root = os.getpid() if root is None else root
    if psutil is not None:
        procs = []
        for child in psutil.Process(root).children(recursive=True):
            try:
                procs.append(Proc(child.pid, child.create_time()))
            except psutil.NoSuchProcess:
                continue
        return procs
    parents: dict[int, list[tuple[int, float]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            parents.setdefault(stat[1], []).append((int(entry), stat[2]))
    found: list[Proc] = []
    todo = [root]
    while todo:
        for pid, start in parents.get(todo.pop(), []):
            found.append(Proc(pid, start))
            todo.append(pid)
    return found


def is_left(proc: Proc) -> bool:
    """Still running (a zombie, exited but not yet reaped, is gone; a new
    process that took the pid is not this one)."""
    if psutil is None:
        stat = _proc_stat(proc.pid)
        return stat is not None and stat[0] != "Z" and stat[2] == proc.start
    try:
        p = psutil.Process(proc.pid)
        return p.create_time() == proc.start and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def wait_gone(procs: Sequence[Proc], timeout_s: float) -> list[Proc]:
    """Wait until every process of ``procs`` ended; those left after ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        for proc in procs:
            await wait_exit(proc)
    return [p for p in procs if is_left(p)]


async def wait_exit(proc: Proc) -> None:
    """Until ``proc`` exits: its pidfd turns readable then (Linux 5.3+);
    elsewhere, by polling."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfds here
        while is_left(proc):  # noqa: ASYNC110 (another process: nothing to wait on)
            await trio.sleep(0.02)
        return
    try:
        if is_left(proc):  # the pidfd is this process's, not a later one's of its pid
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


# -- engines ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """What ``open_engine`` gets: a model and its keyword options."""

    model: str | Any
    options: dict[str, Any] = field(default_factory=dict)

    def open(self, **overrides: Any) -> Any:
        return asyncstep.open_engine(self.model, **{**self.options, **overrides})


def engine_spec(args: argparse.Namespace) -> EngineSpec:
    options: dict[str, Any] = {"device": args.device, "dtype": args.dtype}
    load_format = args.load_format or ("dummy" if args.model in SHAPES else "auto")
    options["load_format"] = load_format
    options.update(dict(args.engine_opt))
    return EngineSpec(args.model, options)


def random_prompt(rng: random.Random, vocab_size: int, lengths: tuple[int, int]) -> list[int]:
    # Ids 3 and up: clear of the usual special tokens (0-2).
    return [rng.randrange(3, vocab_size) for _ in range(rng.randint(*lengths))]


# -- kill campaigns -------------------------------------------------------------


class KillRound(msgspec.Struct):
    """One engine, one SIGKILL, every caller's fate."""

    round: int
    target: str
    delay_s: float
    num_callers: int
    #: Seconds from the kill to each caller's EngineDeadError (late caller included).
    dead_s: list[float]
    late_s: float | None
    #: Seconds from the kill until ``open_engine``'s block was left.
    exit_s: float
    #: Seconds from the kill until every process the engine started was gone.
    gone_s: float | None
    num_processes: int
    left: list[int]
    #: Callers that got anything but EngineDeadError after the kill, or hung.
    failures: list[str]
    error: str
    ok: bool

    @property
    def p50_s(self) -> float:
        return statistics.median(self.dead_s) if self.dead_s else math.nan

    @property
    def max_s(self) -> float:
        return max(self.dead_s) if self.dead_s else math.nan


@dataclass
class _KillState:
    killed_at: float | None = None
    dead_s: list[float] = field(default_factory=list)
    late_s: float | None = None
    failures: list[str] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


async def _doomed_caller(
    engine: Any,
    state: _KillState,
    prompt: list[int],
    params: SamplingParams,
    *,
    stream: bool,
    first_token: trio.Event | None = None,
    late: bool = False,
) -> None:
    """A request that the kill must end with EngineDeadError."""
    try:
        if stream:
            async for chunk in engine.stream(prompt, params):
                if chunk.token_ids and first_token is not None:
                    first_token.set()
        else:
            await engine.generate(prompt, params)
    except EngineDeadError as exc:
        if state.killed_at is None:
            state.failures.append(f"EngineDeadError before the kill: {describe(exc)}")
            return
        seconds = time.monotonic() - state.killed_at
        state.dead_s.append(seconds)
        state.messages.append(describe(exc))
        if late:
            state.late_s = seconds
    except trio.Cancelled:
        state.failures.append("hung: no EngineDeadError before the campaign's timeout")
        raise
    except Exception as exc:
        state.failures.append(f"{type(exc).__name__}: {describe(exc)}")
    else:
        state.failures.append("finished normally: the request outlived the kill")
    finally:
        if first_token is not None:
            first_token.set()  # a caller that failed early holds nobody up


async def kill_round(
    spec: EngineSpec,
    index: int,
    *,
    rank: int | None,
    num_callers: int,
    max_delay_s: float,
    rng: random.Random,
    deadline_s: float = DEADLINE_S,
    hang_s: float = 60.0,
) -> KillRound:
    """Open an engine, load it with ``num_callers`` requests, SIGKILL its
    core (``rank`` None) or that rank, and collect what every caller saw."""
    state = _KillState()
    target = "core" if rank is None else f"rank {rank}"
    procs: list[Proc] = []
    delay = rng.uniform(0.0, max_delay_s)
    error = ""
    before = set(descendants())
    try:
        async with spec.open() as engine:
            procs = [p for p in descendants() if p not in before]
            pid = _target_pid(engine, rank)
            vocab = engine.arch_config.vocab_size
            prompts = [random_prompt(rng, vocab, (4, 24)) for _ in range(num_callers + 1)]
            # Long enough to outlive the kill, whatever the machine's speed.
            params = SamplingParams(
                temperature=0, max_tokens=max(1, engine.max_model_len - 25), ignore_eos=True
            )
            firsts = [trio.Event() for _ in range(0, num_callers, 2)]
            with trio.CancelScope() as hang:
                async with trio.open_nursery() as nursery:
                    for j in range(num_callers):
                        stream = j % 2 == 0
                        nursery.start_soon(
                            functools.partial(
                                _doomed_caller,
                                engine,
                                state,
                                prompts[j],
                                params,
                                stream=stream,
                                first_token=firsts[j // 2] if stream else None,
                            )
                        )
                    with trio.fail_after(hang_s):  # the engine is loaded: every stream has a token
                        for event in firsts:
                            await event.wait()
                    if delay:
                        await trio.sleep(delay)
                    os.kill(pid, signal.SIGKILL)
                    state.killed_at = time.monotonic()
                    hang.deadline = trio.current_time() + hang_s
                    late = functools.partial(
                        _doomed_caller, engine, state, prompts[-1], params, stream=False, late=True
                    )
                    nursery.start_soon(late)
    except EngineDeadError as exc:
        error = describe(exc)
    except Exception as exc:
        state.failures.append(f"open_engine's block: {type(exc).__name__}: {describe(exc)}")
    else:
        state.failures.append("open_engine's block was left without EngineDeadError")
    killed_at = state.killed_at if state.killed_at is not None else time.monotonic()
    exit_s = time.monotonic() - killed_at
    left = await wait_gone(procs, max(0.0, deadline_s - exit_s))  # gone 10 s after the kill
    gone_s = None if left else time.monotonic() - killed_at
    if state.killed_at is not None and len(state.dead_s) < num_callers + 1:
        state.failures.append(f"{num_callers + 1 - len(state.dead_s)} callers without an error")
    ok = (
        not state.failures
        and not left
        and bool(state.dead_s)
        and max(state.dead_s) < deadline_s
        and exit_s < deadline_s
    )
    return KillRound(
        round=index,
        target=target,
        delay_s=delay,
        num_callers=num_callers + 1,
        dead_s=state.dead_s,
        late_s=state.late_s,
        exit_s=exit_s,
        gone_s=gone_s,
        num_processes=len(procs),
        left=[p.pid for p in left],
        failures=state.failures,
        error=error or (state.messages[0] if state.messages else ""),
        ok=ok,
    )


def _target_pid(engine: Any, rank: int | None) -> int:
    if rank is None:
        if not isinstance(engine.core, CoreProcess) or engine.core.pid is None:
            raise ValueError("killing the core needs it in a process of its own (engine_process)")
        return engine.core.pid
    if not 0 <= rank < len(engine.rank_pids):
        raise ValueError(f"no rank {rank}: the engine runs {len(engine.rank_pids)} rank processes")
    return int(engine.rank_pids[rank])


def kill_table(rounds: Sequence[KillRound]) -> list[str]:
    lines = [
        f"{'round':>5} {'target':>7} {'delay s':>7} {'callers':>7} {'p50 s':>6} {'max s':>6} "
        f"{'late s':>6} {'exit s':>6} {'gone s':>6} {'procs':>5} {'left':>4}  ok",
    ]
    for r in rounds:
        late = f"{r.late_s:6.3f}" if r.late_s is not None else f"{'-':>6}"
        gone = f"{r.gone_s:6.3f}" if r.gone_s is not None else f"{'-':>6}"
        lines.append(
            f"{r.round:>5} {r.target:>7} {r.delay_s:7.3f} {r.num_callers:>7} {r.p50_s:6.3f} "
            f"{r.max_s:6.3f} {late} {r.exit_s:6.3f} {gone} {r.num_processes:>5} "
            f"{len(r.left):>4}  {'yes' if r.ok else 'NO'}"
        )
    lines.append(
        "callers: the streams and generate calls under load, and the late caller; p50, max, "
        "late: seconds from the SIGKILL to each caller's EngineDeadError; exit: to leaving "
        "open_engine's block; gone: to the end of the last of the procs the engine started"
    )
    every = [s for r in rounds for s in r.dead_s]
    if every:
        lines.append(
            f"all callers: {len(every)}, EngineDeadError after the kill: p50 "
            f"{statistics.median(every):.3f} s, max {max(every):.3f} s "
            f"(limit {DEADLINE_S:.0f} s); processes left: {sum(len(r.left) for r in rounds)}"
        )
    for r in rounds:
        lines.append(f"round {r.round}: {r.error}")
        lines.extend(f"  FAILURE: {f}" for f in r.failures)
    return lines


async def kill_campaign(args: argparse.Namespace) -> tuple[dict[str, Any], list[str], bool]:
    spec = engine_spec(args)
    if args.command == "kill-rank":
        spec.options.update(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
        if args.tp * args.pp < 2:
            raise SystemExit("kill-rank needs at least 2 ranks (--tp / --pp)")
    elif args.tp * args.pp > 1:
        spec.options.update(tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp)
    rng = random.Random(args.seed)
    rounds = []
    for i in range(args.rounds):
        rank = None
        if args.command == "kill-rank":
            rank = args.rank if args.rank is not None else i % (args.tp * args.pp)
        result = await kill_round(
            spec,
            i,
            rank=rank,
            num_callers=args.callers,
            max_delay_s=args.max_delay,
            rng=rng,
        )
        print(kill_table([result])[1], flush=True)
        rounds.append(result)
    ok = all(r.ok for r in rounds)
    payload = {"rounds": [msgspec.to_builtins(r) for r in rounds], "ok": ok}
    return payload, kill_table(rounds), ok


# -- aborts ---------------------------------------------------------------------


class TokenClock:
    """Counts the tokens the campaign's stream readers took; a deadline in
    tokens (``await clock.wait(n)``) passes once ``n`` more were taken."""

    def __init__(self) -> None:
        self.count = 0
        self._waiters: list[tuple[int, trio.Event]] = []

    def tick(self, num_tokens: int) -> None:
        self.count += num_tokens
        due = [w for w in self._waiters if w[0] <= self.count]
        if due:
            self._waiters = [w for w in self._waiters if w[0] > self.count]
            for _, event in due:
                event.set()

    async def wait(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        event = trio.Event()
        self._waiters.append((self.count + num_tokens, event))
        await event.wait()


@dataclass(frozen=True)
class AbortCampaign:
    """The shape of an ``aborts`` run (the defaults: the script's)."""

    num_aborts: int = 1000
    #: Victims in flight at once.
    victim_lanes: int = 8
    #: Survivors in flight at once.
    survivor_lanes: int = 2
    num_survivor_prompts: int = 16
    survivor_max_tokens: int = 32
    prompt_lengths: tuple[int, int] = (4, 16)
    victim_max_tokens: tuple[int, int] = (8, 48)
    #: Victims whose prompt starts with a survivor's (prefix-cache hits).
    shared_prefix_fraction: float = 0.3
    #: Victims whose abort comes too late (after their last token).
    late_fraction: float = 0.1
    #: "wall": deadlines in seconds (up to ``max_deadline_s``); "tokens": in
    #: tokens the campaign's streams read (up to ``max_deadline_tokens``).
    clock: str = "wall"
    max_deadline_s: float = 0.05
    max_deadline_tokens: int = 40
    seed: int = 0
    timeout_s: float = 900.0


@dataclass(frozen=True)
class Victim:
    index: int
    kind: str
    prompt: list[int]
    params: SamplingParams
    #: Tokens read before the abort (the stream kinds).
    after_tokens: int
    #: The deadline of the generate kinds (seconds or tokens, by the clock).
    deadline: float

    @property
    def request_id(self) -> str:
        return f"victim-{self.index}"


def make_victims(
    campaign: AbortCampaign, survivor_prompts: Sequence[list[int]], vocab_size: int
) -> list[Victim]:
    rng = random.Random(campaign.seed)
    victims = []
    for i in range(campaign.num_aborts):
        kind = KINDS[i % len(KINDS)] if i < len(KINDS) else rng.choice(KINDS)
        prompt = random_prompt(rng, vocab_size, campaign.prompt_lengths)
        if rng.random() < campaign.shared_prefix_fraction:
            base = rng.choice(survivor_prompts)
            prompt = (base[: rng.randint(1, len(base))] + prompt)[: campaign.prompt_lengths[1]]
        max_tokens = rng.randint(*campaign.victim_max_tokens)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        after_tokens = rng.randrange(max_tokens)
        if campaign.clock == "wall":
            deadline = rng.uniform(0.0, campaign.max_deadline_s)
        else:
            deadline = float(rng.randint(0, campaign.max_deadline_tokens))
        if rng.random() < campaign.late_fraction:  # the request ends first
            after_tokens, deadline = max_tokens, math.inf
        victims.append(Victim(i, kind, prompt, params, after_tokens, deadline))
    return victims


class AbortReport(msgspec.Struct):
    num_aborts: int
    clock: str
    #: kind -> {"aborted": landed while the request ran, "finished": it ended first}.
    by_kind: dict[str, dict[str, int]]
    num_landed: int
    num_preemptions: int
    survivors_checked: int
    survivor_mismatches: list[str]
    num_kv_blocks: int
    num_free_kv_blocks: int | None
    #: Blocks whose reference count is not 0 (in-process core only).
    blocks_held: int | None
    requests_left: int | None
    kv_cache_usage: float
    alive_after: bool
    failures: list[str]
    wall_s: float
    ok: bool


async def survivors_alone(
    spec: EngineSpec, campaign: AbortCampaign
) -> tuple[list[list[int]], list[list[int]], int]:
    """The survivors' prompts, their greedy tokens (one request at a time on
    a roomy engine: ``spec`` without ``num_blocks``) and the vocabulary size."""
    options = {k: v for k, v in spec.options.items() if k != "num_blocks"}
    async with asyncstep.open_engine(spec.model, **options) as engine:
        vocab_size = engine.arch_config.vocab_size
        rng = random.Random(campaign.seed + 1)
        prompts = [
            random_prompt(rng, vocab_size, campaign.prompt_lengths)
            for _ in range(campaign.num_survivor_prompts)
        ]
        params = survivor_params(campaign)
        expected = [(await engine.generate(p, params)).token_ids for p in prompts]
    return prompts, expected, vocab_size


class _AbortRun:
    """One campaign on one engine: victims and survivors in lanes."""

    def __init__(
        self,
        engine: Any,
        campaign: AbortCampaign,
        victims: list[Victim],
        survivor_prompts: Sequence[list[int]],
        expected: Sequence[list[int]],
        on_victim: Callable[[], None],
    ) -> None:
        self.engine = engine
        self.campaign = campaign
        self.victims: Iterator[Victim] = iter(victims)
        self.survivor_prompts = survivor_prompts
        self.expected = expected
        self.on_victim = on_victim
        self.clock = TokenClock()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.failures: list[str] = []
        self.mismatches: list[str] = []
        self.survivors_checked = 0
        self.victims_done = False
        self._next_survivor = 0

    # -- the deadline of the generate kinds --

    async def _wait_deadline(self, victim: Victim) -> None:
        if victim.deadline == math.inf:
            await trio.sleep_forever()  # cancelled once the request ended
        elif self.campaign.clock == "wall":
            await trio.sleep(victim.deadline)
        else:
            await self.clock.wait(int(victim.deadline))

    async def _read(self, chunks: Any, victim: Victim, on_token: Callable[[Any, int], bool]) -> Any:
        """Read a stream; ``on_token(chunk, received)`` True stops reading. The last chunk."""
        received = 0
        last = None
        async for chunk in chunks:
            received += len(chunk.token_ids)
            self.clock.tick(len(chunk.token_ids))
            if received > victim.params.max_tokens:
                raise AssertionError(f"{received} tokens for max_tokens {victim.params.max_tokens}")
            last = chunk
            if chunk.finished or on_token(chunk, received):
                break
        return last

    # -- the five kinds --

    async def cancel_stream(self, victim: Victim) -> str:
        last = None
        with trio.CancelScope() as scope:
            if victim.after_tokens == 0:
                scope.cancel()

            def cancel_after(chunk: Any, received: int) -> bool:
                if received >= victim.after_tokens:
                    scope.cancel()
                return False

            last = await self._read(
                self.engine.stream(victim.prompt, victim.params), victim, cancel_after
            )
        if scope.cancelled_caught and not (last is not None and last.finished):
            return "aborted"
        return self._finished(victim, last.finish_reason if last is not None else None)

    async def break_stream(self, victim: Victim) -> str:
        last = await self._read(
            self.engine.stream(victim.prompt, victim.params),
            victim,
            lambda chunk, received: received >= victim.after_tokens,
        )
        if last is not None and last.finished:
            return self._finished(victim, last.finish_reason)
        return "aborted"

    async def abort_stream(self, victim: Victim) -> str:
        engine, aborted = self.engine, False

        def abort_after(chunk: Any, received: int) -> bool:
            nonlocal aborted
            if not aborted and received >= victim.after_tokens:
                engine.abort(victim.request_id)
                aborted = True
            return False

        chunks = engine.stream(victim.prompt, victim.params, request_id=victim.request_id)
        last = await self._read(chunks, victim, abort_after)
        if last is None or not last.finished:
            raise AssertionError(f"the stream of {victim.request_id} ended without a last chunk")
        if last.finish_reason == FinishReason.ABORT:
            if not aborted:
                raise AssertionError(f"{victim.request_id} ended as aborted unasked")
            return "aborted"
        return self._finished(victim, last.finish_reason)

    async def cancel_generate(self, victim: Victim) -> str:
        completion = None
        if self.campaign.clock == "wall":
            with trio.move_on_after(victim.deadline):
                completion = await self.engine.generate(victim.prompt, victim.params)
        else:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_at_deadline() -> None:
                        await self._wait_deadline(victim)
                        scope.cancel()

                    nursery.start_soon(cancel_at_deadline)
                    completion = await self.engine.generate(victim.prompt, victim.params)
                    nursery.cancel_scope.cancel()
        if completion is None:
            return "aborted"
        return self._finished(victim, completion.finish_reason, len(completion.token_ids))

    async def abort_generate(self, victim: Victim) -> str:
        engine = self.engine
        async with trio.open_nursery() as nursery:

            async def abort_at_deadline() -> None:
                await self._wait_deadline(victim)
                engine.abort(victim.request_id)

            nursery.start_soon(abort_at_deadline)
            completion = await engine.generate(
                victim.prompt, victim.params, request_id=victim.request_id
            )
            nursery.cancel_scope.cancel()
        if completion.finish_reason == FinishReason.ABORT:
            return "aborted"
        return self._finished(victim, completion.finish_reason, len(completion.token_ids))

    def _finished(self, victim: Victim, reason: str | None, num_tokens: int | None = None) -> str:
        """A victim that ended before its abort: it must have ended whole."""
        if reason != FinishReason.LENGTH:
            raise AssertionError(f"{victim.request_id} ({victim.kind}) ended as {reason}")
        if num_tokens is not None and num_tokens != victim.params.max_tokens:
            wanted = victim.params.max_tokens
            raise AssertionError(f"{victim.request_id}: {num_tokens} tokens, max_tokens {wanted}")
        return "finished"

    # -- lanes --

    async def victim_lane(self) -> None:
        for victim in self.victims:
            try:
                outcome = await getattr(self, victim.kind)(victim)
            except EngineDeadError:
                raise  # the engine died: the campaign is over
            except Exception as exc:
                self.failures.append(
                    f"{victim.request_id} ({victim.kind}): {type(exc).__name__}: {describe(exc)}"
                )
                outcome = "failed"
            self.outcomes[victim.kind, outcome] += 1
            self.on_victim()

    async def survivor_lane(self) -> None:
        while not self.victims_done:
            i = self._next_survivor % len(self.survivor_prompts)
            stream = self._next_survivor % 2 == 0
            self._next_survivor += 1
            await self.run_survivor(i, stream=stream)

    async def run_survivor(self, i: int, *, stream: bool) -> None:
        params = survivor_params(self.campaign)
        prompt = self.survivor_prompts[i]
        if stream:
            tokens = []
            async for chunk in self.engine.stream(prompt, params):
                tokens.extend(chunk.token_ids)
                self.clock.tick(len(chunk.token_ids))
        else:
            tokens = (await self.engine.generate(prompt, params)).token_ids
        self.survivors_checked += 1
        if tokens != self.expected[i]:
            self.mismatches.append(
                f"survivor {i} ({'stream' if stream else 'generate'}): "
                f"{tokens} != alone {self.expected[i]}"
            )

    async def run(self) -> None:
        async with trio.open_nursery() as survivors:
            for _ in range(self.campaign.survivor_lanes):
                survivors.start_soon(self.survivor_lane)
            async with trio.open_nursery() as lanes:
                for _ in range(self.campaign.victim_lanes):
                    lanes.start_soon(self.victim_lane)
            self.victims_done = True


def survivor_params(campaign: AbortCampaign) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=campaign.survivor_max_tokens, ignore_eos=True)


def kv_blocks_back(engine: Any) -> tuple[int | None, int | None, int | None]:
    """(free blocks, blocks with references, requests the scheduler holds)
    of an in-process core; Nones when the core runs in its own process
    (``statistics().kv_cache_usage`` then says whether every block is back)."""
    core = engine.core
    if not isinstance(core, EngineCore):
        return None, None, None
    scheduler = core.scheduler
    kv = scheduler.kv_cache_manager
    held = sum(1 for block in kv.block_pool.blocks if block.ref_cnt != 0)
    requests = len(scheduler.requests) + len(scheduler.running) + len(scheduler.waiting)
    return kv.num_free_blocks, held, requests


async def run_abort_campaign(
    spec: EngineSpec,
    campaign: AbortCampaign,
    *,
    on_victim: Callable[[], None] = lambda: None,
) -> AbortReport:
    """Survivors' tokens alone, then the campaign on ``spec``'s engine, then
    the checks (every block back, the engine still serving)."""
    prompts, expected, vocab_size = await survivors_alone(spec, campaign)
    victims = make_victims(campaign, prompts, vocab_size)
    started = time.monotonic()
    async with spec.open() as engine:
        run = _AbortRun(engine, campaign, victims, prompts, expected, on_victim)
        with trio.fail_after(campaign.timeout_s):  # a hang is a failure, not a wait
            await run.run()
            await engine.wait_idle()
        stats = engine.statistics()
        free, held, left = kv_blocks_back(engine)
        # Still serving: a survivor once more, alone.
        with trio.fail_after(60):
            before = run.survivors_checked, len(run.mismatches)
            await run.run_survivor(0, stream=False)
        alive = run.survivors_checked == before[0] + 1 and len(run.mismatches) == before[1]
        wall_s = time.monotonic() - started
    by_kind = {k: {"aborted": 0, "finished": 0, "failed": 0} for k in KINDS}
    for (kind, outcome), n in run.outcomes.items():
        by_kind[kind][outcome] = n
    landed = sum(v["aborted"] for v in by_kind.values())
    blocks_ok = stats.kv_cache_usage == 0.0 and held in (None, 0) and left in (None, 0)
    blocks_ok = blocks_ok and free in (None, stats.num_kv_blocks)
    total = sum(sum(v.values()) for v in by_kind.values())
    ok = (
        not run.failures
        and not run.mismatches
        and blocks_ok
        and alive
        and total == campaign.num_aborts
        and stats.num_running_reqs == 0
        and stats.num_waiting_reqs == 0
    )
    return AbortReport(
        num_aborts=total,
        clock=campaign.clock,
        by_kind=by_kind,
        num_landed=landed,
        num_preemptions=stats.num_preemptions,
        survivors_checked=run.survivors_checked,
        survivor_mismatches=run.mismatches,
        num_kv_blocks=stats.num_kv_blocks,
        num_free_kv_blocks=free,
        blocks_held=held,
        requests_left=left,
        kv_cache_usage=stats.kv_cache_usage,
        alive_after=alive,
        failures=run.failures,
        wall_s=wall_s,
        ok=ok,
    )


def abort_table(report: AbortReport) -> list[str]:
    lines = [f"{'kind':<16} {'aborted':>7} {'finished first':>14} {'failed':>6}"]
    for kind, counts in report.by_kind.items():
        lines.append(
            f"{kind:<16} {counts['aborted']:>7} {counts['finished']:>14} {counts['failed']:>6}"
        )
    free = "-" if report.num_free_kv_blocks is None else str(report.num_free_kv_blocks)
    held = "-" if report.blocks_held is None else str(report.blocks_held)
    lines += [
        f"victims {report.num_aborts} (clock: {report.clock}), aborts landed "
        f"{report.num_landed}, preemptions {report.num_preemptions}",
        f"survivors checked {report.survivors_checked}, tokens changed "
        f"{len(report.survivor_mismatches)}",
        f"KV blocks: {report.num_kv_blocks}, usage once idle {report.kv_cache_usage:.3f}, "
        f"free {free}, held {held}; engine alive after: {report.alive_after}",
        f"wall {report.wall_s:.1f} s; {'ok' if report.ok else 'FAILED'}",
    ]
    lines += [f"FAILURE: {f}" for f in report.failures]
    lines += [f"MISMATCH: {m}" for m in report.survivor_mismatches]
    return lines


async def abort_command(args: argparse.Namespace) -> tuple[dict[str, Any], list[str], bool]:
    spec = engine_spec(args)
    spec.options.update(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        engine_process=args.engine_process,
    )
    campaign = AbortCampaign(
        num_aborts=args.aborts,
        victim_lanes=args.lanes,
        survivor_lanes=args.survivor_lanes,
        clock=args.clock,
        max_deadline_s=args.max_deadline_ms / 1000,
        seed=args.seed,
    )
    from rich.progress import Progress

    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("aborts", total=campaign.num_aborts)
        report = await run_abort_campaign(spec, campaign, on_victim=lambda: progress.advance(task))
    lines = abort_table(report)
    return msgspec.to_builtins(report), lines, report.ok


# -- the command line -----------------------------------------------------------


def engine_opt(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``, the value parsed as JSON when it is JSON."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("kill-core", "kill-rank", "aborts"):
        p = sub.add_parser(name)
        p.add_argument(
            "--model", default="tiny-llama", help="a shape name (dummy weights) or a path"
        )
        p.add_argument("--load-format", help="default: dummy for a shape name, else auto")
        p.add_argument("--device", default="auto")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--engine-opt", type=engine_opt, action="append", default=[], metavar="K=V")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", type=Path, help="JSON results (and a .txt next to them)")
        p.add_argument("--note", help="a line for the results' header (the machine's state)")
        if name.startswith("kill"):
            p.add_argument("--rounds", type=int, default=5 if name == "kill-core" else 3)
            p.add_argument("--callers", type=int, default=32 if name == "kill-core" else 16)
            p.add_argument("--max-delay", type=float, default=1.0, help="seconds (uniform)")
            p.add_argument("--tp", type=int, default=2 if name == "kill-rank" else 1)
            p.add_argument("--pp", type=int, default=1)
        if name == "kill-rank":
            p.add_argument("--rank", type=int, help="the rank to kill (default: round %% ranks)")
        if name == "aborts":
            p.add_argument("--aborts", type=int, default=1000)
            p.add_argument("--lanes", type=int, default=8, help="victims in flight")
            p.add_argument("--survivor-lanes", type=int, default=2)
            p.add_argument("--clock", choices=("wall", "tokens"), default="wall")
            p.add_argument("--max-deadline-ms", type=float, default=50.0)
            p.add_argument("--block-size", type=int, default=4)
            p.add_argument("--num-blocks", type=int, default=24)
            p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True)
    return parser.parse_args(argv)


def header(argv: Sequence[str], note: str | None) -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    lines = [
        f"# python3 tests/faults.py {shlex.join(argv)}",
        f"# {platform.node()}: {cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
    ]
    if note:
        lines.append(f"# {note}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = abort_command if args.command == "aborts" else kill_campaign
    payload, lines, ok = trio.run(command, args)
    head = header(argv, args.note)
    print("\n".join([*head, *lines]))
    out = args.out or RESULTS_DIR / f"{args.command.replace('-', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgspec.json.format(msgspec.json.encode({"header": head, **payload})))
    out.with_suffix(".txt").write_text("\n".join([*head, *lines]) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
