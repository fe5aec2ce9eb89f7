"""The pipeline-parallel tensor-dict channel, its buffer pool and the awaitable
Work handles.

The multi-rank scenarios run on ONE spawned 4-rank gloo world (PP=2 x TP=2,
``tests/distributed.py``), shared by the tests of this module: stage 0 (ranks
0, 1) sends, stage 1 (ranks 2, 3) receives, lane 0 = ranks 0 -> 2, lane 1 =
ranks 1 -> 3. Ranks coordinate with barriers on the world group, never with
sleeps; the only timed waits are bounded negative checks ("this send must not
complete within 1 s, its receiver has not posted yet"), which a slow machine
cannot make fail. Facts the scenarios rely on, checked where they matter: a
gloo send does not complete before the peer posted its receive (any size:
gloo's p2p is a rendezvous), and gloo reads the send buffer only then, so a
buffer poisoned too early shows up as NaN on the receiver.

The NCCL test (PP=2 x TP=1 on 2 GPUs, PP=2 x TP=2 on 4) runs where there are
GPUs; it passed on 4 H200s (torch 2.11, NCCL 2.28), where it also failed, as
it should, with the host-side completion wait taken out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import trio
import trio.testing
from distributed import ParallelGroups, RankFailed, World, run_world
from hypothesis import given
from hypothesis import strategies as st

from asyncstep.channels.buffer_pool import BufferPool, BufferPoolStatistics, poison_value
from asyncstep.channels.parallel_state import GroupCoordinator
from asyncstep.channels.tensor_dict import (
    METADATA_BYTES,
    PACK_ALIGNMENT,
    AsyncIntermediateTensors,
    PackedPart,
    PendingSend,
    TensorDictMetadata,
    TensorMetadata,
    decode_metadata,
    drain,
    encode_metadata,
    pack_layout,
    recv_tensor_dict,
    send_tensor_dict,
    warm_up,
)
from asyncstep.device import PendingWork, wait_cuda_event, wait_work

H = 6
#: (step_id, num_tokens): odd and even token counts, one token, reordered sizes.
ROUND_TRIP_STEPS = [(0, 5), (1, 8), (2, 1), (3, 7), (4, 4)]
#: residual is sequence-parallel scattered: every TP rank sends its own shard, no gather.
ALL_GATHER = {"residual": False}


# ---------------------------------------------------------------------------
# Helpers that run inside the ranks


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_step(step: int, num_tokens: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """One step's tensors, reproducible on the receiving side (CPU)."""
    g = torch.Generator().manual_seed(1000 + step)
    shard = torch.Generator().manual_seed(5000 + 10 * step + tp_rank)
    hidden = torch.randn(H, num_tokens, generator=g).t()  # not contiguous
    return {
        "hidden_states": hidden,
        "residual": torch.randn(num_tokens, H, generator=shard),
        "empty": torch.empty(0, H),
        "positions": torch.arange(num_tokens, dtype=torch.int64) + 100 * step,
        # numel 3T: split into lanes for even T, sent whole for odd T.
        "odd": torch.randn(num_tokens, 3, generator=g),
    }


def expected_lanes(data: dict[str, torch.Tensor], tp_size: int) -> list[bool]:
    return [
        tp_size > 1 and ALL_GATHER.get(k, True) and t.numel() > 0 and t.numel() % tp_size == 0
        for k, t in data.items()
    ]


def check_received(it: AsyncIntermediateTensors, step: int, num_tokens: int, tp: Any) -> None:
    expected = make_step(step, num_tokens, tp.rank_in_group)
    assert it.step_id == step
    assert it.keys() == list(expected)
    assert [m.key for m in it.metadata.tensors] == list(expected)
    assert [m.lane for m in it.metadata.tensors] == expected_lanes(expected, tp.world_size)
    for key, want in expected.items():
        got = it[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.cpu(), want), f"step {step} {key}"


def is_poisoned(t: torch.Tensor) -> bool:
    """Every byte is the poison of the uint8 packed buffer ``t`` is a view of."""
    return bool((t.contiguous().view(torch.uint8) == poison_value(torch.uint8)).all())


def stage_kwargs(groups: ParallelGroups) -> dict[str, Any]:
    return {"pp": groups.pp, "tp": groups.tp}


def send_step(groups: ParallelGroups, pool: BufferPool, step: int, num_tokens: int) -> PendingSend:
    data = {k: v.to(_device()) for k, v in make_step(step, num_tokens, groups.tp_rank).items()}
    pending = send_tensor_dict(
        data, step_id=step, pool=pool, all_gather=ALL_GATHER, **stage_kwargs(groups)
    )
    for tensor in data.values():  # the channel copied them: the caller may reuse at once
        tensor.zero_()
    return pending


async def recv_step(
    groups: ParallelGroups, pool: BufferPool, step: int
) -> AsyncIntermediateTensors:
    recv = functools.partial(
        recv_tensor_dict, pool=pool, device=_device(), step_id=step, **stage_kwargs(groups)
    )
    return await trio.to_thread.run_sync(recv)


async def barrier() -> None:
    """Every rank of the world (the default gloo group, not the PP groups)."""
    await trio.to_thread.run_sync(dist.barrier)


# ---------------------------------------------------------------------------
# Scenarios (every rank runs the function)


async def scenario_round_trip(groups: ParallelGroups) -> BufferPoolStatistics:
    pool = BufferPool(poison=True, name=f"rank{groups.world.rank}")
    await trio.to_thread.run_sync(functools.partial(warm_up, device=_device(), pp=groups.pp))
    if groups.pp.is_first_rank:
        pending = [send_step(groups, pool, step, t) for step, t in ROUND_TRIP_STEPS]
        for send in pending:
            await send.wait()
            assert send.done
    else:
        for i, (step, t) in enumerate(ROUND_TRIP_STEPS):
            it = await recv_step(groups, pool, step)
            assert len(it) == 5 and not it.ready
            if i % 2:
                await it.wait()  # off the loop
                assert it.ready
            check_received(it, step, t, groups.tp)  # otherwise lazily, at first use
            it.release()
    return pool.statistics()


async def scenario_buffer_safety(groups: ParallelGroups) -> dict[str, Any]:
    """The receiver reads only after the sender completed, released (poisoned)
    and reused its staging buffers for later steps; then two deliberate misuses
    show that the poison would have shown."""
    pool = BufferPool(poison=True)
    steps = [10, 11, 12, 13]
    t = 4  # the same shapes every step, so buffers are reused
    out: dict[str, Any] = {}
    if groups.pp.is_first_rank:
        p10, p11 = send_step(groups, pool, 10, t), send_step(groups, pool, 11, t)
        before = pool.statistics()
        assert before.in_use == len(p10.buffers) + len(p11.buffers)
        await p10.wait()  # completes once the receiver posted step 10's receives
        assert pool.statistics().in_use == len(p11.buffers)
        p12 = send_step(groups, pool, 12, t)
        # step 12 reuses step 10's (released, poisoned, overwritten) buffers
        assert {id(b) for b in p12.buffers} == {id(b) for b in p10.buffers}
        await p11.wait()
        p13 = send_step(groups, pool, 13, t)
        await p12.wait()
        await p13.wait()
        stats = pool.statistics()
        assert stats.allocated == before.allocated
        assert stats.in_use == 0 and stats.released == stats.acquired
        await barrier()  # (1) every staging buffer has been released and reused
        # Misuse: give the data buffers back before the send completed. gloo
        # reads them only once the receiver posted (after barrier 2): poisoned.
        bad = send_step(groups, pool, 14, t)
        for buf in bad.buffers[1:]:
            pool.release(buf)
        await barrier()  # (2)
        await bad.work.wait()
        pool.release(bad.buffers[0])
        out["stats"] = pool.statistics()
    else:
        received = [await recv_step(groups, pool, step) for step in steps]
        await barrier()  # (1)
        for it, step in zip(received, steps, strict=True):
            check_received(it, step, t, groups.tp)
        # Misuse: keep a tensor past release(): it reads as poison.
        kept = received[0]["hidden_states"]
        kept_positions = received[0]["positions"]
        received[0].release()
        assert torch.isnan(kept).all()
        # A lane key: its gathered buffer is an int64 one of the pool.
        assert (kept_positions == poison_value(torch.int64)).all()
        with pytest.raises(RuntimeError, match="used after release"):
            received[0]["hidden_states"]
        for it in received[1:]:
            it.release()
        await barrier()  # (2)
        poisoned = await recv_step(groups, pool, 14)
        await poisoned.wait()
        assert torch.isnan(poisoned["hidden_states"]).all()
        assert torch.isnan(poisoned["residual"]).all()
        # Gathered from the sender's packed (uint8) buffer, poisoned byte by byte.
        assert is_poisoned(poisoned["positions"])
        poisoned.release()
        out["stats"] = pool.statistics()
    return out


DRAIN_STEPS = 4
DRAIN_SHAPE = (256, 1024)  # 1 MiB of float32 per tensor


def drain_data(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"hidden_states": torch.randn(DRAIN_SHAPE, generator=g), "step": torch.tensor([step])}


async def scenario_drain_on_cancel(groups: ParallelGroups) -> dict[str, Any]:
    pool = BufferPool(poison=True)
    kwargs = stage_kwargs(groups)
    steps = [20 + i for i in range(DRAIN_STEPS)]
    out: dict[str, Any] = {}
    if groups.pp.is_first_rank:
        pending: list[PendingSend] = []
        ready, cancelled = trio.Event(), trio.Event()

        async def send_task() -> None:
            try:
                for step in steps:
                    data = drain_data(step)
                    pending.append(send_tensor_dict(data, step_id=step, pool=pool, **kwargs))
                # The premise: no send can complete before the receiver posts.
                with trio.move_on_after(1.0) as probe:
                    await pending[0].wait()  # abandoned on cancel; drain joins it
                assert probe.cancelled_caught, "a gloo send completed with no receive posted"
                assert not any(p.done for p in pending)
                out["in_use_before_drain"] = pool.statistics().in_use
                ready.set()
                await trio.sleep_forever()
            finally:
                cancelled.set()
                # Inside the cancelled nursery: drain's own shield lets it wait.
                out["drained"] = await drain(pending, timeout_s=30)

        async def let_receiver_go() -> None:
            await cancelled.wait()
            await barrier()  # the receiver may now post its receives

        async with trio.open_nursery() as outer:
            outer.start_soon(let_receiver_go)
            async with trio.open_nursery() as nursery:  # the send task's nursery
                nursery.start_soon(send_task)
                await ready.wait()
                nursery.cancel_scope.cancel()
        out["done"] = [p.done for p in pending]
        out["stats"] = pool.statistics()
        out["buffers_per_send"] = len(pending[0].buffers)
    else:
        await barrier()
        for step in steps:
            it = await recv_step(groups, pool, step)
            await it.wait()
            for key, want in drain_data(step).items():
                assert torch.equal(it[key], want), (step, key)
            it.release()
        out["stats"] = pool.statistics()
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(str(record.msg))


async def scenario_drain_timeout(groups: ParallelGroups) -> dict[str, Any]:
    """A send that cannot complete in time keeps its buffers; a later wait gives them back."""
    pool = BufferPool(poison=True)
    out: dict[str, Any] = {}
    if groups.pp.is_first_rank:
        records = _Records()
        logger = logging.getLogger("asyncstep.channels.tensor_dict")
        logger.addHandler(records)
        send = send_tensor_dict(drain_data(30), step_id=30, pool=pool, **stage_kwargs(groups))
        out["drained"] = await drain([send], timeout_s=0.3)
        out["done_after_drain"] = send.done
        out["in_use_after_drain"] = pool.statistics().in_use
        out["warned"] = any("pp_send_drain_incomplete" in m for m in records.messages)
        logger.removeHandler(records)
        await barrier()
        await send.wait()  # joins the thread drain abandoned; waits no handle twice
        out["done"] = send.done
        out["stats"] = pool.statistics()
    else:
        await barrier()
        it = await recv_step(groups, pool, 30)
        assert torch.equal(it["hidden_states"], drain_data(30)["hidden_states"])
        it.release()
    return out


async def scenario_wait_work_cancel(groups: ParallelGroups) -> bool | None:
    """wait_work delivers a cancellation only after the send completed."""
    if groups.pp.is_first_rank:
        buf = torch.full((1024,), 3.0)
        work = dist.isend(buf, dst=groups.pp.next_rank, group=groups.pp.device_group)
        assert work is not None
        started = trio.Event()
        caught: list[bool] = []

        async def waiter(scope: trio.CancelScope) -> None:
            with scope:
                started.set()
                await wait_work(work)
            caught.append(scope.cancelled_caught)
            buf.fill_(float("nan"))  # were the wait early, the receiver would see NaN

        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()
            nursery.start_soon(waiter, scope)
            await started.wait()
            scope.cancel()  # the send cannot complete yet: the receiver waits at the barrier
            await barrier()
        return caught[0]
    await barrier()
    got = torch.empty(1024)
    dist.irecv(got, src=groups.pp.prev_rank, group=groups.pp.device_group).wait()
    assert (got == 3.0).all()
    return None


async def scenario_step_mismatch(groups: ParallelGroups) -> str | None:
    pool = BufferPool()
    if groups.pp.is_first_rank:
        # Metadata only (an empty tensor): nothing is left in flight after the error.
        send = send_tensor_dict(
            {"empty": torch.empty(0)}, step_id=41, pool=pool, **stage_kwargs(groups)
        )
        await send.wait()
        return None
    with pytest.raises(RuntimeError, match="expected the tensors of step 40") as info:
        await recv_step(groups, pool, 40)
    return str(info.value)


def mixed_step(step: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes, an empty tensor and, at TP = 2, lane keys of odd byte sizes."""
    g = torch.Generator().manual_seed(7000 + step)
    shard = torch.Generator().manual_seed(8000 + 10 * step + tp_rank)
    return {
        "hidden_states": torch.randn(5, 6, generator=g).to(torch.bfloat16),  # lane: 30 bytes
        "scale": torch.randn(3, generator=g, dtype=torch.float64),  # numel 3: whole
        "empty": torch.empty(0, 4, dtype=torch.int64),
        "mask": torch.rand(5, generator=g) > 0.5,  # bool, whole
        "residual": torch.randn(2, 3, generator=shard).half(),  # a shard: whole, not gathered
        "ids": torch.arange(6, dtype=torch.int32) + 10 * step,  # lane
    }


@contextlib.contextmanager
def counting_p2p(calls: list[str]) -> Iterator[None]:
    """Record each ``dist.isend``/``dist.irecv`` as ``"isend meta"``,
    ``"irecv packed"``... (the metadata message is the METADATA_BYTES one)."""
    originals = dist.isend, dist.irecv

    def wrap(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            what = "meta" if tensor.numel() == METADATA_BYTES else "packed"
            assert what == "meta" or tensor.dtype == torch.uint8
            calls.append(f"{name} {what}")
            return op(tensor, *args, **kwargs)

        return counted

    dist.isend, dist.irecv = wrap("isend", dist.isend), wrap("irecv", dist.irecv)
    try:
        yield
    finally:
        dist.isend, dist.irecv = originals


async def scenario_packed(groups: ParallelGroups) -> dict[str, Any]:
    """Step 70 (mixed dtypes, lanes, an empty tensor) and step 71 (empty
    tensors only) each take one device op per direction (none for 71)."""
    pool = BufferPool(poison=True)
    kwargs = stage_kwargs(groups)
    empties = {"a": torch.empty(0), "b": torch.empty(2, 0, dtype=torch.int8)}
    calls: list[str] = []
    out: dict[str, Any] = {"calls": calls}
    with counting_p2p(calls):
        if groups.pp.is_first_rank:
            data = mixed_step(70, groups.tp_rank)
            send = send_tensor_dict(data, step_id=70, pool=pool, all_gather=ALL_GATHER, **kwargs)
            out["works"] = [len(send.work.works)]
            layout, total = pack_layout(decode_metadata(send.buffers[0]), groups.tp.world_size)
            out["part_bytes"] = [part.nbytes for part in layout]
            out["packed_bytes"] = (send.buffers[1].numel(), total)
            only_empty = send_tensor_dict(empties, step_id=71, pool=pool, **kwargs)
            out["works"].append(len(only_empty.work.works))
            await send.wait()
            await only_empty.wait()
        else:
            it = await recv_step(groups, pool, 70)
            want = mixed_step(70, groups.tp_rank)
            assert [m.lane for m in it.metadata.tensors] == [True, False, False, False, False, True]
            for key, expected in want.items():
                got = it[key]
                assert got.dtype == expected.dtype and got.shape == expected.shape, key
                assert torch.equal(got, expected), key
            # The keys sent whole are views of the one packed buffer.
            storages = {it[k].untyped_storage().data_ptr() for k in ("scale", "mask", "residual")}
            assert len(storages) == 1
            it.release()
            it = await recv_step(groups, pool, 71)
            assert {k: (v.shape, v.dtype) for k, v in it.tensors.items()} == {
                k: (v.shape, v.dtype) for k, v in empties.items()
            }
            it.release()
    out["stats"] = pool.statistics()
    return out


# ---------------------------------------------------------------------------
# The tests


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    with World(4, tp_size=2, pp_size=2, dist_timeout_s=60) as w:
        yield w


def _is_sender(rank: int) -> bool:
    return rank < 2


def test_round_trip_pp2_tp2(world: World) -> None:
    for rank, stats in enumerate(world.run(scenario_round_trip, timeout_s=60)):
        assert stats.in_use == 0 and stats.released == stats.acquired, (rank, stats)
        if _is_sender(rank):
            # A metadata message and one packed buffer per step.
            assert stats.acquired == 2 * len(ROUND_TRIP_STEPS)
        else:
            # The same, and a gathered buffer per lane key.
            assert stats.acquired > 2 * len(ROUND_TRIP_STEPS)


def test_buffer_safety_and_poison(world: World) -> None:
    for rank, out in enumerate(world.run(scenario_buffer_safety, timeout_s=60)):
        stats = out["stats"]
        assert stats.in_use == 0 and stats.released == stats.acquired, (rank, stats)


def test_drain_on_cancel(world: World) -> None:
    results = world.run(scenario_drain_on_cancel, timeout_s=60)
    for rank, out in enumerate(results):
        stats = out["stats"]
        assert stats.in_use == 0 and stats.released == stats.acquired, (rank, stats)
        if _is_sender(rank):
            assert out["in_use_before_drain"] == DRAIN_STEPS * out["buffers_per_send"]
            assert out["drained"] == DRAIN_STEPS
            assert out["done"] == [True] * DRAIN_STEPS


def test_drain_timeout_keeps_buffers(world: World) -> None:
    for rank, out in enumerate(world.run(scenario_drain_timeout, timeout_s=60)):
        if _is_sender(rank):
            assert out["drained"] == 0 and not out["done_after_drain"]
            assert out["in_use_after_drain"] == 2  # metadata + the packed tensors
            assert out["warned"]
            assert out["done"] and out["stats"].in_use == 0


def test_wait_work_delivers_cancel_after_completion(world: World) -> None:
    results = world.run(scenario_wait_work_cancel, timeout_s=60)
    assert results[0] is True and results[1] is True


def test_step_id_mismatch(world: World) -> None:
    results = world.run(scenario_step_mismatch, timeout_s=60)
    assert "received step 41" in results[2] and "received step 41" in results[3]


def test_packed_mixed_dtypes_one_device_op_per_direction(world: World) -> None:
    for rank, out in enumerate(world.run(scenario_packed, timeout_s=60)):
        stats = out["stats"]
        assert stats.in_use == 0 and stats.released == stats.acquired, (rank, stats)
        if _is_sender(rank):
            # step 70: metadata (gloo) + one packed send; step 71: metadata only.
            assert out["calls"] == ["isend meta", "isend packed", "isend meta"], rank
            assert out["works"] == [2, 1]
            # bf16 lane half, 3 float64, empty, 5 bool, float16 shard, int32 lane half.
            assert out["part_bytes"] == [30, 24, 0, 5, 12, 12]
            assert out["packed_bytes"] == (4 * PACK_ALIGNMENT + 12,) * 2
        else:
            assert out["calls"] == ["irecv meta", "irecv packed", "irecv meta"], rank


# -- the harness itself


async def scenario_fail_on_rank_1(groups: ParallelGroups) -> None:
    if groups.world.rank == 1:
        raise ValueError("boom on rank 1")
    await barrier()  # rank 1 never comes: the others hang until killed


def test_harness_names_the_failed_rank_and_kills_hung_ones() -> None:
    with pytest.raises(RankFailed, match="rank 1 failed first") as info:
        run_world(scenario_fail_on_rank_1, world_size=2, timeout_s=30, failure_grace_s=0.5)
    assert "boom on rank 1" in str(info.value)
    assert "rank 0: no answer (killed)" in str(info.value)


# ---------------------------------------------------------------------------
# Single-process unit tests


def test_metadata_round_trip() -> None:
    meta = TensorDictMetadata(
        step_id=7,
        tensors=[
            TensorMetadata("hidden_states", "bfloat16", [3, 4], True),
            TensorMetadata("empty", "float32", [0, 4], False),
        ],
    )
    buf = encode_metadata(meta)
    assert buf.dtype == torch.uint8 and buf.numel() == METADATA_BYTES
    assert decode_metadata(buf) == meta


def test_metadata_too_large() -> None:
    meta = TensorDictMetadata(
        step_id=0,
        tensors=[TensorMetadata(f"key_{i:04d}" * 4, "float32", [1], False) for i in range(200)],
    )
    with pytest.raises(ValueError, match="more than the 4096-byte metadata message"):
        encode_metadata(meta)
    # send_tensor_dict checks before taking a buffer or posting a send.
    fake = GroupCoordinator(
        ranks=(0, 1), rank_in_group=0, device_group=object(), cpu_group=object()
    )  # type: ignore[arg-type]
    pool = BufferPool()
    tensors = {f"key_{i:04d}" * 4: torch.zeros(1) for i in range(200)}
    with pytest.raises(ValueError, match="metadata"):
        send_tensor_dict(tensors, step_id=0, pool=pool, pp=fake, tp=GroupCoordinator.single())
    assert pool.statistics().acquired == 0


def _entry(key: str, dtype: str, shape: list[int], lane: bool = False) -> TensorMetadata:
    return TensorMetadata(key, dtype, shape, lane)


def test_pack_layout_mixed_dtypes() -> None:
    meta = TensorDictMetadata(
        step_id=0,
        tensors=[
            _entry("hidden_states", "bfloat16", [3, 5]),  # 30 bytes
            _entry("empty", "float32", [0, 4]),
            _entry("scale", "float64", [4, 4], lane=True),  # 8 of 16 at TP 2
            _entry("mask", "bool", [3]),
            _entry("big", "float32", [100]),  # 400 bytes: spans two alignment units
            _entry("last", "int16", [1]),
        ],
    )
    layout, total = pack_layout(meta, tp_size=2)
    assert layout == [
        PackedPart(0, 30),
        PackedPart(30, 0),
        PackedPart(256, 64),
        PackedPart(512, 3),
        PackedPart(768, 400),
        PackedPart(1280, 2),
    ]
    assert total == 1282
    with pytest.raises(RuntimeError, match="cannot gather"):
        pack_layout(meta, tp_size=3)  # 16 elements do not split in 3 lanes
    with pytest.raises(RuntimeError, match="cannot gather"):
        pack_layout(meta, tp_size=1)
    assert pack_layout(TensorDictMetadata(0, [_entry("e", "int8", [0])]), 1) == (
        [PackedPart(0, 0)],
        0,
    )


_DTYPES = ["bfloat16", "float16", "float32", "float64", "int8", "int32", "int64", "bool", "uint8"]


@given(
    entries=st.lists(
        st.tuples(
            st.sampled_from(_DTYPES),
            st.lists(st.integers(0, 9), min_size=1, max_size=3),
            st.booleans(),
        ),
        max_size=8,
    ),
    tp_size=st.sampled_from([1, 2, 4]),
)
def test_pack_layout_parts_are_aligned_disjoint_and_fit(
    entries: list[tuple[str, list[int], bool]], tp_size: int
) -> None:
    metas = [
        _entry(f"k{i}", dtype, shape, lane=lane and tp_size > 1 and math.prod(shape) % tp_size == 0)
        for i, (dtype, shape, lane) in enumerate(entries)
    ]
    layout, total = pack_layout(TensorDictMetadata(0, metas), tp_size)
    assert len(layout) == len(metas)
    end = 0
    for entry, part in zip(metas, layout, strict=True):
        numel = math.prod(entry.shape) // (tp_size if entry.lane else 1)
        assert part.nbytes == numel * getattr(torch, entry.dtype).itemsize
        if part.nbytes:
            assert part.offset % PACK_ALIGNMENT == 0 and part.offset >= end  # aligned, in order
            end = part.offset + part.nbytes
    assert total == end
    used = [p for p in layout if p.nbytes]
    assert total <= sum(p.nbytes for p in used) + PACK_ALIGNMENT * max(len(used) - 1, 0)


def test_corrupt_metadata() -> None:
    buf = torch.full((METADATA_BYTES,), 0xFF, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="corrupt tensor-dict metadata"):
        decode_metadata(buf)
    buf[:8] = torch.tensor([4, 0, 0, 0, 1, 2, 3, 4], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="corrupt tensor-dict metadata"):
        decode_metadata(buf)


def test_pool_statistics_reuse_and_clear() -> None:
    pool = BufferPool()
    a = pool.acquire((4, 2), torch.float32)
    b = pool.acquire(8, torch.float32)
    assert a.shape == (4, 2) and b.shape == (8,)
    pool.release(a)
    assert pool.acquire([4, 2], torch.float32) is a  # reused
    assert pool.acquire((4, 2), torch.float16) is not a  # another dtype, another buffer
    s = pool.statistics()
    assert (s.acquired, s.released, s.in_use, s.allocated, s.idle) == (4, 1, 3, 3, 0)
    for buf in (a, b):
        pool.release(buf)
    assert pool.clear() == 2
    assert pool.statistics().idle == 0


def test_pool_misuse_is_an_error() -> None:
    pool = BufferPool()
    buf = pool.acquire((4,), torch.float32)
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(buf.view(2, 2))
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.empty(4))
    pool.release(buf)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(buf)
    assert pool.statistics().released == 1


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.int64, -(2**63)),
        (torch.uint8, 255),
        (torch.bool, True),
    ],
)
def test_pool_poison(dtype: torch.dtype, value: Any) -> None:
    pool = BufferPool(poison=True)
    buf = pool.acquire((3,), dtype)
    buf.fill_(0)
    kept = buf  # a use after release, on purpose
    pool.release(buf)
    if value is None:
        assert torch.isnan(kept).all()
    else:
        assert (kept == value).all()


def test_async_intermediate_tensors_release_twice() -> None:
    pool = BufferPool(poison=True)
    buf = pool.acquire((6,), torch.float32)
    buf.copy_(torch.arange(6.0))
    entry = TensorMetadata("hidden_states", "float32", [2, 3], False)
    it = AsyncIntermediateTensors(
        metadata=TensorDictMetadata(step_id=3, tensors=[entry]),
        src=0,
        tp=GroupCoordinator.single(),
        device=torch.device("cpu"),
        work=PendingWork([]),
        received=[(entry, buf)],
        buffers=[buf],
        pool=pool,
    )
    assert torch.equal(it["hidden_states"], torch.arange(6.0).view(2, 3))
    it.release()
    with pytest.raises(RuntimeError, match="released twice"):
        it.release()
    with pytest.raises(RuntimeError, match="used after release"):
        _ = it.tensors
    assert pool.statistics().in_use == 0


class FakeWork:
    """A Work whose wait() blocks until ``gate`` is set; counts its waits."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = 0

    def wait(self) -> bool:
        self.calls += 1
        self.entered.set()
        self.gate.wait()
        return True


@pytest.mark.trio
async def test_pending_work_abandoned_wait_is_joined_not_repeated() -> None:
    work = FakeWork()
    pending = PendingWork([work])  # type: ignore[list-item]
    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()

        async def first() -> None:
            with scope:
                await pending.wait(abandon_on_cancel=True)

        nursery.start_soon(first)
        await trio.to_thread.run_sync(work.entered.wait)
        scope.cancel()  # the task leaves at once; its thread keeps waiting
    assert scope.cancelled_caught and not pending.done
    async with trio.open_nursery() as nursery:
        nursery.start_soon(pending.wait)
        await trio.testing.wait_all_tasks_blocked()
        work.gate.set()
    assert pending.done and work.calls == 1


@pytest.mark.trio
async def test_wait_work_shields_until_completion() -> None:
    work = FakeWork()
    finished: list[bool] = []

    async def waiter(scope: trio.CancelScope) -> None:
        with scope:
            await wait_work(work)  # type: ignore[arg-type]
            finished.append(True)  # not reached: the cancel is delivered after the wait
        finished.append(False)

    async with trio.open_nursery() as nursery:
        scope = trio.CancelScope()
        nursery.start_soon(waiter, scope)
        await trio.to_thread.run_sync(work.entered.wait)
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert finished == []  # still waiting, although cancelled
        work.gate.set()
    assert finished == [False] and scope.cancelled_caught and work.calls == 1


# ---------------------------------------------------------------------------
# NCCL (run on a machine with 2 or 4 GPUs: PP=2 x TP=1 or PP=2 x TP=2)


async def scenario_cuda(groups: ParallelGroups) -> dict[str, Any]:
    results: dict[str, Any] = {}
    warm_up(device=_device(), pp=groups.pp)
    event = torch.cuda.Event(blocking=True)
    event.record()
    await wait_cuda_event(event)
    results["round_trip"] = await scenario_round_trip(groups)
    pool = BufferPool(poison=True)
    steps = [50 + i for i in range(3)]
    if groups.pp.is_first_rank:
        sends = [send_step(groups, pool, step, 64) for step in steps]
        results["drained"] = await drain(sends, timeout_s=30)
    else:
        for step in steps:
            it = await recv_step(groups, pool, step)
            await it.wait()
            check_received(it, step, 64, groups.tp)
            it.release()
    # Completion on NCCL (whose future completes at enqueue, and whose wait()
    # only orders a stream): the receiver takes the metadata, then holds back
    # its tensor receive. The send cannot complete meanwhile, so wait() must
    # not return within a second; then the receiver posts and wait() ends.
    # Measured on H200s (NCCL 2.28): sends of up to 32 MiB complete before
    # the receive is posted (NCCL buffers them); 256 MiB ones do not.
    rows = 8192 * groups.tp.world_size  # 256 MiB of float32 per lane
    cpu_barrier = functools.partial(dist.barrier, group=groups.pp.cpu_group)
    if groups.pp.is_first_rank:
        big = {"hidden_states": torch.full((rows, 8192), 7.0, device=_device())}
        send = send_tensor_dict(big, step_id=60, pool=pool, **stage_kwargs(groups))
        del big
        with trio.move_on_after(1.0) as probe:
            await send.wait()
        results["waited_before_receive"] = probe.cancelled_caught and not send.done
        await trio.to_thread.run_sync(cpu_barrier)  # the receiver may post now
        await send.wait()
        assert send.done
    else:
        # The wire protocol by hand, to post the tensor receive late.
        meta_buf = torch.empty(METADATA_BYTES, dtype=torch.uint8)
        src = groups.pp.prev_rank
        dist.irecv(meta_buf, src=src, group=groups.pp.cpu_group).wait()
        meta = decode_metadata(meta_buf)
        (entry,) = meta.tensors
        assert entry.lane == (groups.tp.world_size > 1)
        (part,), total = pack_layout(meta, groups.tp.world_size)
        assert part == PackedPart(0, 8192 * 8192 * 4) and total == part.nbytes
        packed = torch.empty(total, dtype=torch.uint8, device=_device())
        await trio.to_thread.run_sync(cpu_barrier)
        dist.irecv(packed, src=src, group=groups.pp.device_group).wait()
        assert bool((packed.view(torch.float32) == 7.0).all())
    torch.cuda.synchronize()
    results["stats"] = pool.statistics()
    return results


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_round_trip_and_drain() -> None:
    world_size = 4 if torch.cuda.device_count() >= 4 else 2
    results = run_world(
        scenario_cuda, world_size=world_size, tp_size=world_size // 2, backend="nccl", timeout_s=120
    )
    for out in results:
        for stats in (out["round_trip"], out["stats"]):
            assert stats.in_use == 0 and stats.released == stats.acquired
    assert results[0]["drained"] == 3
    assert all(results[rank]["waited_before_receive"] for rank in range(world_size // 2))
