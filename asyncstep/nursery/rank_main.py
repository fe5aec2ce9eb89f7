"""The per-rank entry: one ``trio.run`` per rank process.

``python -m asyncstep.rank --engine HOST:PORT`` connects to the engine,
receives its setup, joins the torch.distributed world, loads its shard of the
model, reports how many KV blocks fit, then serves steps as a
:class:`~asyncstep.nursery.RankActor` until the engine says stop. The rank,
world size and local rank come from the arguments or from torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so ``torchrun ... -m asyncstep.rank --engine HOST:PORT``
runs it across machines. A rank may start before its engine listens: it
retries the connection for ``--connect-timeout`` seconds.

The rank proves that it knows the launch's secret, and checks that the
engine does, before anything else (:mod:`asyncstep.channels.framing`): the
secret comes from ``--secret-file`` or the environment variable
``ASYNCSTEP_SECRET`` (which the rank then drops from its environment, so its
own children do not inherit it), never from the command line. A rank
started by the engine inherits, as ``--store-fd``, the loopback socket on
which rank 0 serves the rendezvous store.

A rank never outlives a failure: its error goes to the engine as
:class:`RankFailed`, and if a thread is stuck (a collective whose peer died),
a watchdog ends the process after ``--exit-grace`` seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio
import msgspec
import torch
import trio

from asyncstep.channels.control import (
    ControlMessage,
    ControlStream,
    Grammar,
    Hello,
    InitKVCache,
    RankFailed,
    RankReady,
    RankSetup,
    Shutdown,
    Step,
    StepOutput,
)
from asyncstep.channels.framing import (
    SECRET_ENV,
    AuthenticationError,
    connect_peer,
    read_secret_file,
)
from asyncstep.channels.parallel_state import ParallelGroups, destroy_distributed, init_distributed
from asyncstep.datatypes import ModelRunnerOutput, RankInput, SchedulerOutput
from asyncstep.device import switch_interval
from asyncstep.errors import ConfigError, leaves, root_cause
from asyncstep.logging import bind_rank, configure_logging, get_logger
from asyncstep.logging.spans import now_us, record_span
from asyncstep.models.model_loader import LoadedModel, cpu_threads, load_model
from asyncstep.models.weight_reads import weight_reads
from asyncstep.nursery.pipe import PipeStage
from asyncstep.nursery.rank import RankActor
from asyncstep.runner.build import build_runner, kv_cache_blocks
from asyncstep.runner.capture import capture_cuda_graphs
from asyncstep.runner.cpu_threads import run_in_ending_thread
from asyncstep.runner.model_runner import ModelRunner

log = get_logger("rank")


_M = TypeVar("_M")


class EngineGone(Exception):
    """The engine closed the control connection."""


@dataclass
class RankIdentity:
    rank: int
    world_size: int
    local_rank: int


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="python -m asyncstep.rank", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--engine", required=True, metavar="HOST:PORT", help="the engine's control address"
    )
    parser.add_argument("--rank", type=int, default=int(env.get("RANK", 0)))
    parser.add_argument("--world-size", type=int, default=int(env.get("WORLD_SIZE", 1)))
    parser.add_argument("--local-rank", type=int, default=int(env.get("LOCAL_RANK", 0)))
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--log-json", metavar="FILE")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=60.0,
        help="seconds to keep trying the engine's address before giving up",
    )
    parser.add_argument(
        "--exit-grace",
        type=float,
        default=5.0,
        help="seconds a failing rank waits for stuck work before it exits anyway",
    )
    parser.add_argument(
        "--secret-file",
        metavar="FILE",
        help=f"the file holding the engine's control secret (default: ${SECRET_ENV})",
    )
    parser.add_argument(
        "--store-fd",
        type=int,
        metavar="FD",
        help="rank 0: an inherited socket, bound, to serve the rendezvous store on",
    )
    args = parser.parse_args(argv)
    try:
        args.secret = _secret(args.secret_file)
    except ConfigError as exc:
        parser.error(str(exc))
    return args


def _secret(secret_file: str | None) -> str:
    """The control secret: the file's, else the environment's (then dropped
    from the environment)."""
    env_secret = os.environ.pop(SECRET_ENV, None)
    if secret_file is not None:
        return read_secret_file(secret_file)
    if not env_secret:
        raise ConfigError(f"no control secret: set {SECRET_ENV} or give --secret-file")
    return env_secret


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level, args.log_json)
    identity = RankIdentity(args.rank, args.world_size, args.local_rank)
    bind_rank(identity.rank)
    try:
        return trio.run(
            serve_rank,
            args.engine,
            identity,
            args.exit_grace,
            args.secret,
            args.connect_timeout,
            args.store_fd,
        )
    except BaseException as exc:
        # Ctrl-C in a terminal reaches every rank of its process group too.
        if any(isinstance(e, KeyboardInterrupt) for e in leaves(exc)):
            return 130
        raise


#: Pause between attempts to reach an engine that does not listen yet.
CONNECT_RETRY_S = 0.2


async def connect_engine(engine_address: str, secret: str, timeout_s: float) -> ControlStream:
    """Connect to the engine at ``HOST:PORT`` and pass the handshake,
    retrying while nothing listens there (the engine may start after its
    ranks) for at most ``timeout_s`` seconds; then raise ``ConnectionError``
    naming the address. An engine that refuses the secret, or does not know
    it, is a ``ConnectionError`` at once."""
    host, _, port = engine_address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"--engine must be HOST:PORT, got {engine_address!r}")
    last: OSError | None = None
    with anyio.move_on_after(timeout_s):
        while True:
            try:
                socket_stream = await anyio.connect_tcp(host or "127.0.0.1", int(port))
            except OSError as exc:
                last = exc
                await anyio.sleep(CONNECT_RETRY_S)
                continue
            stream = ControlStream(socket_stream, ControlMessage)
            try:
                await _authenticate(stream, secret)
            except AuthenticationError as exc:
                raise ConnectionError(f"{engine_address}: {exc}") from None
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                raise ConnectionError(
                    f"the engine at {engine_address} refused this rank: is its secret "
                    f"({SECRET_ENV} or --secret-file) the engine's?"
                ) from None
            return stream
    raise ConnectionError(
        f"no engine answered at {engine_address} within {timeout_s:g} s (last error: {last})"
    )


async def _authenticate(stream: ControlStream, secret: str) -> None:
    """The handshake; the connection is closed if it fails."""
    try:
        await connect_peer(stream, secret)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        raise


async def serve_rank(
    engine_address: str,
    identity: RankIdentity,
    exit_grace: float,
    secret: str,
    connect_timeout_s: float = 60.0,
    store_fd: int | None = None,
) -> int:
    stream = await connect_engine(engine_address, secret, connect_timeout_s)
    await stream.send(Hello(identity.rank, identity.world_size, os.getpid(), socket.gethostname()))
    try:
        await _serve(stream, identity, store_fd)
    except Exception as exc:
        _exit_soon(exit_grace)  # whatever happens below, the process ends
        if any(isinstance(e, EngineGone) for e in leaves(exc)):  # (raised inside task groups)
            return 1
        error = root_cause(exc)
        log.debug("rank failed", error=repr(error), traceback=traceback.format_exc())
        # (An engine gone too has nobody to tell.)
        gone = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
        with anyio.move_on_after(2, shield=True), contextlib.suppress(*gone):
            await stream.send(RankFailed(identity.rank, f"{type(error).__name__}: {error}"))
        return 1
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
    destroy_distributed()
    return 0


async def _serve(stream: ControlStream, identity: RankIdentity, store_fd: int | None) -> None:
    setup = await _expect(stream, RankSetup)
    config = setup.config
    runner, groups, loaded = await run_in_ending_thread(
        lambda: build_rank(setup, identity, store_fd)
    )
    num_blocks = kv_cache_blocks(config, runner, loaded)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    reads = weight_reads(loaded.model)
    await stream.send(RankReady(identity.rank, num_blocks, weight_bytes, str(loaded.device), reads))
    init = await _expect(stream, InitKVCache)
    await run_in_ending_thread(lambda: runner.initialize_kv_cache(init.num_blocks))
    await anyio.to_thread.run_sync(_capture, runner, identity.rank == 0)
    actor = RankActor(
        runner,
        rank=identity.rank,
        groups=groups,
        pp_tensor_lanes=config.parallel.pp_tensor_lanes,
        launch_inline=config.compilation.launch_inline,
    )
    if actor.pipe is not None:
        await anyio.to_thread.run_sync(_warm_up, actor.pipe, loaded.device)
    # What is alive now lives as long as the rank: out of the collector's
    # reach (as the engine core's freeze_gc_heap; a full collection over
    # the model and its graphs held a step loop ~0.1 s).
    gc.collect()
    gc.freeze()
    with switch_interval(config.scheduler.gil_switch_interval_s):
        await _run_actor(actor, stream, is_driver=actor.is_driver)


async def _run_actor(actor: RankActor, stream: ControlStream, *, is_driver: bool) -> None:
    inbox_tx, inbox_rx = anyio.create_memory_object_stream[RankInput](1)
    outbox_tx, outbox_rx = anyio.create_memory_object_stream[ModelRunnerOutput](1)

    async def read_engine() -> None:
        async with inbox_tx:
            while True:
                try:
                    message = await stream.receive()
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    raise EngineGone("the engine closed the connection") from None
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, Grammar):
                    await inbox_tx.send(message.grammar_output)
                    continue
                if not isinstance(message, Step):
                    raise RuntimeError(f"unexpected control message {type(message).__name__}")
                step_id = message.scheduler_output.step_id
                record_span("step_in", "recv", now_us(), 0, step=step_id)  # arrival marker
                await inbox_tx.send(message.scheduler_output)

    async def write_engine() -> None:
        async with outbox_rx:
            async for output in outbox_rx:
                if is_driver:
                    await stream.send(StepOutput(output))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read_engine)
        tg.start_soon(write_engine)
        await actor.run(inbox_rx, outbox_tx)


async def _expect(stream: ControlStream, kind: type[_M]) -> _M:
    try:
        message = await stream.receive()
    except (anyio.EndOfStream, anyio.IncompleteRead):
        raise EngineGone("the engine closed the connection") from None
    if isinstance(message, Shutdown):
        raise EngineGone("the engine shut down before the rank was ready")
    if not isinstance(message, kind):
        raise RuntimeError(f"expected {kind.__name__}, got {type(message).__name__}")
    return message


def build_rank(
    setup: RankSetup, identity: RankIdentity, store_fd: int | None = None
) -> tuple[ModelRunner, ParallelGroups, LoadedModel]:
    """Join the world and load this rank's shard (blocking: runs in a thread),
    all as the engine's config says, on this rank's device (rank 0 serves
    the rendezvous store on ``store_fd`` when given)."""
    config, parallel = setup.config, setup.config.parallel
    device = _rank_device(config.model.device, identity.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = init_distributed(
        rank=identity.rank,
        world_size=identity.world_size,
        tp_size=parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
        init_method=setup.init_method or "env://",
        backend="nccl" if device.type == "cuda" else "gloo",
        store_fd=store_fd if identity.rank == 0 else None,
        enable_expert_parallel=parallel.enable_expert_parallel,
    )
    # The same seed on every rank: TP ranks of the last stage sample identically.
    torch.manual_seed(config.model.seed)
    if device.type == "cpu":
        # The rank's share of the cores from its first op: loading on every
        # core in each rank at once oversubscribes them (the runner keeps this count).
        torch.set_num_threads(cpu_threads(parallel))
    loaded = load_model(
        msgspec.structs.replace(config.model, device=str(device)),
        sequence_parallel=parallel.sequence_parallel,
        with_tokenizer=False,  # the engine detokenizes
    )
    runner = build_runner(config, loaded)
    _inject_fault(runner, identity.rank)
    return runner, groups, loaded


#: Testing hook: ``ASYNCSTEP_INJECT_FAULT=RANK:STEP`` makes that rank's step raise.
FAULT_ENV = "ASYNCSTEP_INJECT_FAULT"


def _inject_fault(runner: ModelRunner, rank: int) -> None:
    target = os.environ.get(FAULT_ENV)
    if not target:
        return
    fault_rank, _, fault_step = target.partition(":")
    if int(fault_rank) != rank:
        return
    execute = runner.execute_model

    def execute_or_fail(so: SchedulerOutput, *args: object, **kwargs: object) -> object:
        if so.step_id == int(fault_step):
            raise RuntimeError(f"injected fault in rank {rank} at step {so.step_id}")
        return execute(so, *args, **kwargs)  # type: ignore[arg-type]

    runner.execute_model = execute_or_fail  # type: ignore[method-assign,assignment]


def _warm_up(pipe: PipeStage, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pipe.warm_up()


def _rank_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def _exit_soon(grace: float) -> None:
    """End the process after ``grace`` seconds even if a thread is stuck in a
    collective whose peer died (such a thread cannot be cancelled)."""

    def hard_exit() -> None:
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(grace, hard_exit)
    timer.daemon = True
    timer.start()


def _capture(runner: ModelRunner, show_progress: bool) -> None:
    if runner.device.type == "cuda":
        torch.cuda.set_device(runner.device)
    capture_cuda_graphs(runner, show_progress)
