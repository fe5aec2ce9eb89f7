"""``asyncstep.device.stream``: awaiting concurrent futures on Trio and asyncio
(shielded or not, already done, woken after the loop ended), the HostStream's
order, results, errors, markers, statistics and closing, CPU events, and (with
CUDA only) CUDA events, their waiter threads and the device clock.

No sleeps: worker-thread work is gated with ``threading.Event``s."""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Callable

import anyio
import pytest
import torch
import trio
import trio.testing

from asyncstep.device import (
    CpuEvent,
    CudaEvent,
    DeviceClock,
    HostStream,
    await_future,
    cuda_waiter,
    record_event,
    switch_interval,
    wait_cuda_event,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Gated:
    """A callable for a worker thread: says it started, waits for the gate,
    then marks itself finished and returns ``value``."""

    def __init__(self, value: object = None) -> None:
        self.value = value
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.finished = False

    def __call__(self) -> object:
        self.entered.set()
        assert self.gate.wait(timeout=10), "the test never opened the gate"
        self.finished = True
        return self.value

    async def wait_entered(self) -> None:
        await anyio.to_thread.run_sync(self.entered.wait)


def complete_later(future: concurrent.futures.Future[int], gate: threading.Event) -> None:
    """Complete ``future`` from another thread once ``gate`` opens."""

    def body() -> None:
        assert gate.wait(timeout=10)
        future.set_result(42)

    threading.Thread(target=body, daemon=True).start()


# ---------------------------------------------------------------------------
# await_future


@pytest.mark.anyio
async def test_await_future_woken_from_another_thread(anyio_backend: str) -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    gate = threading.Event()
    complete_later(future, gate)
    results: list[int] = []

    async def waiter() -> None:
        results.append(await await_future(future))

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert results == [] and not future.done()
        gate.set()
    assert results == [42]


@pytest.mark.anyio
async def test_await_future_raises_the_futures_exception(anyio_backend: str) -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    gate = threading.Event()

    def fail() -> None:
        assert gate.wait(timeout=10)
        future.set_exception(ValueError("boom"))

    threading.Thread(target=fail, daemon=True).start()
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await await_future(future)
        except ValueError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        gate.set()
    assert [str(e) for e in errors] == ["boom"]


@pytest.mark.anyio
async def test_await_future_already_done(anyio_backend: str) -> None:
    done: concurrent.futures.Future[str] = concurrent.futures.Future()
    done.set_result("ready")
    assert await await_future(done) == "ready"
    assert await await_future(done, shield=False) == "ready"
    failed: concurrent.futures.Future[str] = concurrent.futures.Future()
    failed.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        await await_future(failed)


@pytest.mark.anyio
async def test_shielded_wait_delivers_cancel_after_completion(anyio_backend: str) -> None:
    with HostStream("shield") as stream:
        work = Gated("value")
        seen_at_cancel: list[bool] = []
        scope = anyio.CancelScope()

        async def waiter() -> None:
            with scope:
                try:
                    await stream.run(work)
                except anyio.get_cancelled_exc_class():
                    seen_at_cancel.append(work.finished)
                    raise

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await work.wait_entered()
            scope.cancel()
            await anyio.wait_all_tasks_blocked()
            assert seen_at_cancel == []  # cancelled, but still waiting for the work
            work.gate.set()
        assert seen_at_cancel == [True] and scope.cancelled_caught


@pytest.mark.anyio
async def test_unshielded_wait_leaves_at_once(anyio_backend: str) -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    left: list[bool] = []

    async def waiter(scope: anyio.CancelScope) -> None:
        with scope:
            await await_future(future, shield=False)
        left.append(True)

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        tg.start_soon(waiter, scope)
        await anyio.wait_all_tasks_blocked()
        scope.cancel()
    assert left == [True] and scope.cancelled_caught
    assert not future.done() and not future.cancelled()
    # Completing it later, with the loop still running, is harmless.
    future.set_result(1)
    await anyio.wait_all_tasks_blocked()


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
@pytest.mark.parametrize("from_thread", [False, True])
def test_completion_after_the_loop_ended_does_not_raise(
    backend: str, from_thread: bool, caplog: pytest.LogCaptureFixture
) -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()

    async def main() -> None:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await await_future(future, shield=False)
        assert scope.cancelled_caught

    anyio.run(main, backend=backend)  # the loop is gone (and asyncio's closed)
    caplog.set_level(logging.DEBUG)
    if from_thread:
        thread = threading.Thread(target=future.set_result, args=(7,))
        thread.start()
        thread.join()
    else:
        future.set_result(7)
    assert future.result() == 7
    # concurrent.futures logs (not raises) an exception of a done-callback.
    assert not [r for r in caplog.records if "exception calling callback" in r.getMessage()]


@pytest.mark.anyio
async def test_completion_racing_the_registration(anyio_backend: str) -> None:
    """A future that completes between the done() check and the registration
    runs the callback in the loop thread; it still wakes the waiter."""

    class LateFuture(concurrent.futures.Future[int]):
        def done(self) -> bool:
            was_done = super().done()
            if not was_done:
                self.set_result(5)  # completes "right after" the check
            return was_done

    assert await await_future(LateFuture()) == 5


# ---------------------------------------------------------------------------
# HostStream


@pytest.mark.trio
async def test_host_stream_runs_in_submission_order() -> None:
    with HostStream("order") as stream:
        first = Gated()
        order: list[int] = []
        threads: set[str] = set()

        def step(i: int) -> int:
            order.append(i)
            threads.add(threading.current_thread().name)
            return i * i

        stream.submit(first)
        futures = [stream.submit(step, i) for i in range(20)]
        await first.wait_entered()
        assert order == []  # all queued behind the gated one
        first.gate.set()
        assert [await await_future(f) for f in futures] == [i * i for i in range(20)]
        assert order == list(range(20))
        (name,) = threads
        assert name.startswith("asyncstep-stream-order")
        assert name != threading.current_thread().name


@pytest.mark.trio
async def test_an_inline_host_stream_runs_on_the_callers_thread() -> None:
    stream = HostStream("inline", inline=True)
    ran_on: list[str] = []

    def step(i: int) -> int:
        ran_on.append(threading.current_thread().name)
        return i * i

    future = stream.submit(step, 3)
    assert future.done() and future.result() == 9  # ran during submit
    assert await stream.run(step, 4) == 16
    assert ran_on == [threading.current_thread().name] * 2

    def fail() -> None:
        raise ZeroDivisionError("inline")

    with pytest.raises(ZeroDivisionError, match="inline"):
        await stream.run(fail)
    marker = stream.record_event()
    await marker.wait()
    assert marker.query() and marker.timestamp_us() > 0
    assert stream.statistics().completed == 3
    await stream.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(step, 1)


@pytest.mark.trio
async def test_run_returns_values_and_raises_errors() -> None:
    with HostStream("run") as stream:
        total = await stream.run(torch.add, torch.ones(3), torch.ones(3))
        assert torch.equal(total, torch.full((3,), 2.0))
        assert await stream.run(lambda: "x") == "x"

        def fail() -> None:
            raise ZeroDivisionError("on the stream")

        with pytest.raises(ZeroDivisionError, match="on the stream"):
            await stream.run(fail)
        assert await stream.run(int, "7") == 7  # an error does not stop the stream


@pytest.mark.trio
async def test_record_event_completes_after_earlier_work() -> None:
    with HostStream("marker") as stream:
        work = Gated()
        finished_at: list[int] = []

        def stamp() -> None:
            finished_at.append(time.time_ns() // 1000)

        stream.submit(work)
        stream.submit(stamp)
        marker = stream.record_event()
        await work.wait_entered()
        assert not marker.query()
        with pytest.raises(RuntimeError, match="not completed"):
            marker.timestamp_us()
        work.gate.set()
        await marker.wait()
        assert marker.query() and work.finished
        assert marker.timestamp_us() >= finished_at[0]
        marker.synchronize()  # complete: returns at once
        assert stream.statistics().submitted == 2  # markers are not counted


@pytest.mark.trio
async def test_cpu_event_timestamps_are_ordered() -> None:
    with HostStream("events") as stream:
        events = [await stream.run(record_event, torch.device("cpu")) for _ in range(5)]
        events += [stream.record_event() for _ in range(5)]
        for event in events:
            await event.wait()
        assert all(isinstance(e, CpuEvent) and e.query() for e in events)
        stamps = [e.timestamp_us() for e in events]
        assert stamps == sorted(stamps)
        assert abs(stamps[-1] - time.time_ns() // 1000) < 10_000_000
    now = CpuEvent.record()
    assert now.query() and now.timestamp_us() <= time.time_ns() // 1000
    assert isinstance(record_event(None), CpuEvent)


@pytest.mark.trio
async def test_statistics() -> None:
    with HostStream("stats") as stream:
        assert stream.statistics().submitted == 0

        def fail() -> None:
            raise RuntimeError("counted anyway")

        for _ in range(3):
            await stream.run(torch.mm, torch.ones(16, 16), torch.ones(16, 16))
        with pytest.raises(RuntimeError):
            await stream.run(fail)
        stats = stream.statistics()
        assert (stats.name, stats.submitted, stats.completed) == ("stats", 4, 4)
        assert stats.busy_s > 0
        with pytest.raises(AttributeError):
            stats.submitted = 0  # type: ignore[misc]


@pytest.mark.trio
async def test_submit_after_close_raises() -> None:
    with HostStream("closing") as stream:
        future = stream.submit(lambda: 1)
    assert future.result() == 1 and stream.closed
    with pytest.raises(RuntimeError, match="stream 'closing' is closed"):
        stream.submit(lambda: 2)
    with pytest.raises(RuntimeError, match="stream 'closing' is closed"):
        stream.record_event()
    stream.close()  # again: harmless


@pytest.mark.trio
async def test_aclose_waits_for_submitted_work_without_blocking() -> None:
    stream = HostStream("aclose")
    work = Gated()
    stream.submit(work)
    closed = trio.Event()

    async def closer() -> None:
        await stream.aclose()
        closed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(closer)
        await work.wait_entered()
        await trio.testing.wait_all_tasks_blocked()
        assert stream.closed and not closed.is_set()  # the loop is free meanwhile
        with pytest.raises(RuntimeError, match="closed"):
            stream.submit(lambda: None)
        work.gate.set()
    assert closed.is_set() and work.finished


@pytest.mark.trio
async def test_close_can_drop_the_work_not_started() -> None:
    """What a rank does with its receive thread on the way out: the running
    call finishes, the queued ones never start."""
    stream = HostStream("dropping")
    running, queued = Gated("ran"), Gated("queued")
    first, second = stream.submit(running), stream.submit(queued)
    await running.wait_entered()
    stream.close(wait=False, cancel_pending=True)
    assert second.cancelled() and not queued.entered.is_set()
    running.gate.set()
    assert await trio.to_thread.run_sync(first.result, 10) == "ran"
    assert not queued.entered.is_set()


def test_host_stream_cpu_device_needs_no_initializer() -> None:
    with HostStream("cpu", torch.device("cpu")) as stream:
        assert stream.device == torch.device("cpu")
        assert stream.submit(lambda: 3).result() == 3


# ---------------------------------------------------------------------------
# CUDA (skipped without a GPU)


def _busy(device: torch.device) -> Callable[[], None]:
    a = torch.randn(1024, 1024, device=device)

    def work() -> None:
        for _ in range(20):
            a.mm(a)

    return work


@needs_cuda
@pytest.mark.anyio
async def test_cuda_event_wait_and_timestamps(anyio_backend: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    work = _busy(device)
    events: list[CudaEvent] = []
    for _ in range(4):
        work()
        event = record_event(device)
        assert isinstance(event, CudaEvent)
        events.append(event)
    await events[-1].wait()
    assert all(e.query() for e in events)
    for event in events:
        await event.wait()  # complete: returns at once
    stamps = [e.timestamp_us() for e in events]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    # The device clock maps onto the host's: the last event completed in the past.
    assert stamps[-1] <= time.time_ns() // 1000 + 1000
    assert time.time_ns() // 1000 - stamps[0] < 10_000_000


@needs_cuda
def test_cuda_event_before_completion() -> None:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _busy(torch.device("cuda"))()
    event = CudaEvent.record(stream=side)
    assert event.stream is side
    if not event.query():
        with pytest.raises(RuntimeError, match="not completed"):
            event.timestamp_us()
    event.synchronize()
    assert event.query() and event.timestamp_us() > 0


@needs_cuda
def test_device_clock_is_calibrated_against_the_host() -> None:
    clock = DeviceClock.for_device("cuda")
    assert DeviceClock.for_device(torch.cuda.current_device()) is clock
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    event.synchronize()
    after = time.time_ns() // 1000
    stamp = clock.timestamp_us(event)
    assert after - 5_000 < stamp <= after + 1_000  # in the past (give or take the skew)


@needs_cuda
@pytest.mark.trio
async def test_waiter_threads_and_wait_cuda_event() -> None:
    assert cuda_waiter("cuda") is cuda_waiter(torch.cuda.current_device())
    side = torch.cuda.Stream()
    assert cuda_waiter(stream=side) is not cuda_waiter()
    _busy(torch.device("cuda"))()
    event = torch.cuda.Event(blocking=True)
    event.record()
    await wait_cuda_event(event)
    assert event.query()


@needs_cuda
@pytest.mark.trio
async def test_host_stream_sets_the_threads_cuda_device() -> None:
    last = torch.cuda.device_count() - 1
    with HostStream("cuda", torch.device("cuda", last)) as stream:
        assert await stream.run(torch.cuda.current_device) == last
        event = await stream.run(record_event, stream.device)
        await event.wait()
        assert event.query()


def test_switch_interval_is_set_for_the_block_and_restored() -> None:
    before = sys.getswitchinterval()
    with switch_interval(0.0007):
        assert sys.getswitchinterval() == pytest.approx(0.0007)
    assert sys.getswitchinterval() == before
    with switch_interval(None):
        assert sys.getswitchinterval() == before
