"""Multi-process worlds for tests: spawn N ranks once, run functions on them.

Each rank is a process of the ``spawn`` start method that joins a
``torch.distributed`` world with :func:`asyncstep.channels.parallel_state.init_distributed`
(``file://`` rendezvous in a temporary directory), then runs, one after the
other, the functions the test sends it, each under its own ``trio.run``::

    async def scenario(groups: ParallelGroups, size: int) -> float:
        ...  # runs on every rank; groups.world.rank, groups.tp, groups.pp

    with World(4, tp_size=2, pp_size=2) as world:   # spawns, waits for init
        results = world.run(scenario, 128, timeout_s=60)   # one value per rank

    results = run_world(scenario, 128, world_size=2)        # spawn, run once, stop

A function must be a module-level ``async def`` (the ranks import it by name)
taking the rank's :class:`ParallelGroups` and the picklable ``args``; its
return value must be picklable. ``World.run`` raises :class:`RankFailed` when
a rank raised (every rank's traceback in the message, the first failure
named), died, or did not answer within ``timeout_s`` (a hung collective): the
world is then killed, and later ``run`` calls raise at once. The processes are
always killed when the ``with`` block ends, however it ends.

The ranks use one intra-op thread each, so a 4-rank world fits on 2 cores.
Spawning costs ~1-1.5 s per rank here: share a ``World`` between the tests of
a module (a module-scoped fixture) rather than spawning one per test.
"""

from __future__ import annotations

import contextlib
import faulthandler
import ipaddress
import multiprocessing
import multiprocessing.connection
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import trio

from asyncstep.channels.parallel_state import (
    ParallelGroups,
    destroy_distributed,
    init_distributed,
)

RankFn = Callable[..., Awaitable[Any]]

#: How long the other ranks may still answer once one rank failed.
FAILURE_GRACE_S = 3.0


class RankFailed(RuntimeError):
    """A rank raised, died or hung; the world has been killed."""


def _rank_main(
    rank: int,
    world_size: int,
    tp_size: int,
    pp_size: int,
    backend: str,
    init_method: str,
    dist_timeout_s: float,
    env: Mapping[str, str],
    conn: multiprocessing.connection.Connection,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    # The parent aborts a hung rank (SIGABRT): faulthandler prints every
    # thread's stack to stderr (the test's output) first. No core files.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    faulthandler.enable(all_threads=True)
    try:
        _serve(rank, world_size, tp_size, pp_size, backend, init_method, dist_timeout_s, conn)
    finally:
        # Skip the interpreter's teardown (~0.5 s per rank with torch loaded).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _serve(
    rank: int,
    world_size: int,
    tp_size: int,
    pp_size: int,
    backend: str,
    init_method: str,
    dist_timeout_s: float,
    conn: multiprocessing.connection.Connection,
) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        groups = init_distributed(
            rank=rank,
            world_size=world_size,
            tp_size=tp_size,
            pp_size=pp_size,
            init_method=init_method,
            backend=backend,
            timeout_s=dist_timeout_s,
        )
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the parent is gone
                return
            if message is None:
                return
            fn, args = message
            try:
                value = trio.run(fn, groups, *args)
            except BaseException:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", value))
    finally:
        destroy_distributed()


def free_port() -> int:
    """A port free a moment ago, for a test that must name one to a process
    it cannot hand a bound socket (torchrun, a listener started later).
    Another process may take it in between: never do this outside tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of
    ``pids`` holds, from /proc (the kernel's own table; Linux only)."""
    owner: dict[int, int] = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                owner[int(link[8:-1])] = pid
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            if state == "0A" and inode in owner:  # 0A: TCP_LISTEN
                host, port = local.split(":")
                found.append((owner[inode], _proc_address(host), int(port, 16)))
    return found


def _proc_address(hex_address: str) -> str:
    """/proc/net/tcp{,6} writes an address as 32-bit words in host order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


class World:
    """``world_size`` spawned ranks (``tp_size`` x ``pp_size``) that run test functions."""

    def __init__(
        self,
        world_size: int,
        *,
        tp_size: int = 1,
        pp_size: int | None = None,
        backend: str = "gloo",
        start_timeout_s: float = 60.0,
        dist_timeout_s: float = 60.0,
        env: Mapping[str, str] | None = None,
        failure_grace_s: float = FAILURE_GRACE_S,
    ) -> None:
        self.world_size = world_size
        self.tp_size = tp_size
        self.pp_size = pp_size if pp_size is not None else world_size // tp_size
        self.backend = backend
        self.start_timeout_s = start_timeout_s
        self.dist_timeout_s = dist_timeout_s
        self.env = dict(env or {})
        self.failure_grace_s = failure_grace_s
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._tmpdir: str | None = None
        self._broken: str | None = None

    def __enter__(self) -> World:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Spawn the ranks and wait until every one joined the world."""
        ctx = multiprocessing.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="asyncstep-world-")
        init_method = f"file://{os.path.join(self._tmpdir, 'rendezvous')}"
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(
                    rank,
                    self.world_size,
                    self.tp_size,
                    self.pp_size,
                    self.backend,
                    init_method,
                    self.dist_timeout_s,
                    self.env,
                    child,
                ),
                name=f"asyncstep-rank-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start", self.start_timeout_s)

    def run(self, fn: RankFn, *args: Any, timeout_s: float = 60.0) -> list[Any]:
        """Run ``trio.run(fn, groups, *args)`` on every rank; their return values, by rank."""
        if self._broken is not None:
            raise RankFailed(f"the world was killed earlier: {self._broken}")
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout_s)

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        results: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        first_failure: int | None = None
        by_conn = {id(conn): rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while len(results) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waiting = [c for r, c in enumerate(self._conns) if r not in results]
            sentinels = [p.sentinel for r, p in enumerate(self._procs) if r not in results]
            ready = multiprocessing.connection.wait([*waiting, *sentinels], timeout=remaining)
            for obj in ready:
                if isinstance(obj, int):
                    rank = by_sentinel[obj]
                    conn = self._conns[rank]
                    if rank in results or conn.poll():
                        continue  # its answer is read through the pipe
                    code = self._procs[rank].exitcode
                    results[rank] = ("error", f"rank {rank} died (exit code {code})")
                else:
                    assert isinstance(obj, multiprocessing.connection.Connection)
                    rank = by_conn[id(obj)]
                    try:
                        results[rank] = obj.recv()
                    except EOFError:
                        results[rank] = ("error", f"rank {rank} closed its pipe (died)")
                if results[rank][0] != "ok" and first_failure is None:
                    first_failure = rank
                    # The others get a short grace to report, then are killed.
                    deadline = min(deadline, time.monotonic() + self.failure_grace_s)
        if first_failure is None and len(results) == self.world_size:
            return [results[rank][1] for rank in range(self.world_size)]
        missing = [rank for rank in range(self.world_size) if rank not in results]
        if first_failure is not None:
            head = f"{what}: rank {first_failure} failed first"
        else:
            head = f"{what}: ranks {missing} did not answer within {timeout_s:.0f} s (hung?)"
        lines = [head]
        for rank in range(self.world_size):
            if rank in missing:
                lines.append(f"--- rank {rank}: no answer (killed)")
            elif results[rank][0] != "ok":
                lines.append(f"--- rank {rank} failed:\n{results[rank][1]}")
        self._broken = head
        self._dump_stacks(missing)
        self.close()
        raise RankFailed("\n".join(lines))

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Abort the hung ranks so that they print every thread's stack to stderr."""
        procs = [self._procs[rank] for rank in ranks]
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGABRT)
        for proc in procs:
            proc.join(5.0)

    def close(self) -> None:
        """Stop the ranks (politely if they are idle, by force otherwise); idempotent."""
        if self._broken is None:
            for conn in self._conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(None)
            deadline = time.monotonic() + 5.0
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def run_world(
    fn: RankFn,
    *args: Any,
    world_size: int,
    tp_size: int = 1,
    pp_size: int | None = None,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    failure_grace_s: float = FAILURE_GRACE_S,
) -> list[Any]:
    """Spawn a world, run ``fn`` once on every rank, stop the world; values by rank."""
    with World(
        world_size,
        tp_size=tp_size,
        pp_size=pp_size,
        backend=backend,
        env=env,
        failure_grace_s=failure_grace_s,
    ) as world:
        return world.run(fn, *args, timeout_s=timeout_s)


__all__ = ["FAILURE_GRACE_S", "ParallelGroups", "RankFailed", "World", "run_world"]
