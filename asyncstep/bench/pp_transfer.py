"""Pipeline transfer with TP > 1: lanes against whole tensors.

    python3 -m asyncstep.bench.pp_transfer --tp 2 --pp 2 --out FILE

* ``lane``: each TP rank of stage 0 sends ``1/TP`` of every tensor to its peer
  of stage 1 (its lane), which all-gathers the slices over its TP group
  (vLLM's ``all_gather_group`` path; asyncstep's default).
* ``whole``: each TP rank sends the whole tensors to its peer; no gather.

Both go through the tensor-dict channel the ranks use (``send_tensor_dict`` /
``recv_tensor_dict``: metadata over the PP group's gloo CPU group first, then
the tensors over the device group, pooled buffers). Send completion is awaited off the hop's path
(as a rank's send task does). ``*_raw`` variants move
the same bytes with bare ``isend``/``irecv`` (and ``all_gather_into_tensor``)
into preallocated tensors: the transport alone, without the metadata hop.
``gather_raw`` times the all-gather alone (one ``all_gather_into_tensor`` per
key into the full tensors, over the TP group; with ``--tp 1`` over the two-GPU
PP group instead, so a two-GPU machine measures every component of the lane
transfer without two ranks sharing a GPU). ``meta_raw`` times the metadata
alone: a ``METADATA_BYTES`` uint8 tensor over the PP group's gloo CPU group,
the channel's first hop (returned tensors: the sent ones, unchecked).

A step's dict is ``{hidden_states, residual}``, each ``[tokens, hidden]``
(llama-8b: 4096; bf16 on CUDA, fp32 on the CPU). Timing is a round trip, so no
clocks are compared across processes: stage 0 sends, stage 1 waits for the
tensors and sends them back the same way, stage 0 waits for them (on CUDA until
its stream has them); one way = half the round trip. ``--iters`` round trips
run back to back after one barrier (``time_mode``); median of ``--repeats``.
The returned tensors are checked equal to the sent ones. Floor (CUDA): the
bytes one link carries at the measured point-to-point bandwidth (lane:
``bytes / TP`` plus the all-gather's ``(TP - 1) / TP`` of the bytes; whole: all
bytes).

For the channel modes the host time of each phase of a hop (the send's
posting, the receive thread's entry and exit, the blocking receive, the first
use) is printed for lane 0 of both stages; ``--profile DIR`` writes a cProfile
of each stage's event-loop thread.

``--rank-gpus N`` lays the ranks on N GPUs (see :mod:`asyncstep.bench.rank_gpus`); with two
GPUs and PP = 2 x TP = 2, lane 0 runs GPU 0 -> 1 and lane 1 GPU 1 -> 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import trio

from asyncstep.bench.measurement import record, row_case
from asyncstep.bench.rank_gpus import rank_gpus
from asyncstep.bench.results import now, write
from asyncstep.channels.buffer_pool import BufferPool
from asyncstep.channels.parallel_state import (
    ParallelGroups,
    all_gather_into_tensor,
    init_distributed,
)
from asyncstep.channels.tensor_dict import recv_tensor_dict, send_tensor_dict
from asyncstep.channels.tensor_wire import METADATA_BYTES

KEYS = ("hidden_states", "residual")
MODES = ("lane", "whole", "lane_raw", "whole_raw", "gather_raw", "meta_raw")
Row = dict[str, Any]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, nargs="+", help="default: 1 .. 4096 (CPU: .. 1024)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--iters", type=int, default=50, help="hops per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda if there is one")
    parser.add_argument("--rank-gpus", type=int, metavar="N", help="default: every GPU")
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=0.0005,
        help="sys.setswitchinterval on each rank (a serving rank's default; 0: Python's)",
    )
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="cProfile each stage's event loop thread"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tokens is None:
        args.tokens = [1, 16, 64, 256, 1024] + ([4096] if args.device == "cuda" else [])
    if args.pp != 2:
        parser.error("the round trip needs exactly two stages (--pp 2)")
    return args


# -- one rank -------------------------------------------------------------------


class Rank:
    """This rank's groups, device and a world barrier."""

    def __init__(self, groups: ParallelGroups, device: torch.device, barrier: Any) -> None:
        self.groups = groups
        self.device = device
        self.stage = groups.pp.rank_in_group
        self._barrier_group = barrier
        self.pool = BufferPool()
        self.sends: trio.Nursery | None = None

    def defer(self, send: Any) -> None:
        """Wait for a send's completion off the hop's path, as a rank's send task
        does (its buffers go back to the pool when it completed)."""
        assert self.sends is not None
        self.sends.start_soon(send.wait)

    def barrier(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self._barrier_group)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


class Phases:
    """Host time per phase of a channel hop on this rank (µs; printed per mode)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, name: str, at: float | None = None) -> None:
        now = time.perf_counter() if at is None else at
        self.times.setdefault(name, []).append((now - self._last) * 1e6)
        self._last = now

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v) for k, v in self.times.items()}


async def channel_hop(
    rank: Rank, tensors: dict[str, torch.Tensor], step: int, lanes: bool, phases: Phases
) -> Any:
    """Send ``tensors`` to the other stage through the tensor-dict channel and
    receive its reply: stage 0 sends first, stage 1 replies with what it got.
    ``phases`` gets the host time of each part (the receive's thread entry and
    exit hops apart from the blocking receive itself, which includes waiting
    for the peer)."""
    gather = None if lanes else dict.fromkeys(KEYS, False)
    pp, tp = rank.groups.pp, rank.groups.tp
    stamps: dict[str, float] = {}

    def receive() -> Any:
        stamps["in_thread"] = time.perf_counter()
        got = recv_tensor_dict(pool=rank.pool, device=rank.device, step_id=step, pp=pp, tp=tp)
        stamps["received"] = time.perf_counter()
        return got

    async def receive_in_thread() -> Any:
        got = await trio.to_thread.run_sync(receive)
        phases.mark("thread_entry", stamps["in_thread"])
        phases.mark("recv_blocking (incl. peer)", stamps["received"])
        phases.mark("thread_exit")
        await got.wait()
        phases.mark("materialize")
        return got

    phases.start()
    if rank.stage == 0:
        sent = send_tensor_dict(
            tensors, step_id=step, pool=rank.pool, pp=pp, tp=tp, all_gather=gather
        )
        phases.mark("send_post")
        back = await receive_in_thread()
        got = {k: v.clone() for k, v in back.tensors.items()}
        rank.sync()
        phases.mark("clone_sync")
        back.release()
        rank.defer(sent)
        return got
    received = await receive_in_thread()
    reply = send_tensor_dict(
        received.tensors, step_id=step, pool=rank.pool, pp=pp, tp=tp, all_gather=gather
    )
    phases.mark("send_post")
    received.release()
    rank.defer(reply)
    return None


def meta_hop(rank: Rank, tensors: dict[str, torch.Tensor]) -> Any:
    """The metadata's round trip alone: gloo send/recv of a METADATA_BYTES tensor."""
    pp = rank.groups.pp
    buf = torch.zeros(METADATA_BYTES, dtype=torch.uint8)
    if rank.stage == 0:
        dist.send(buf, dst=pp.next_rank, group=pp.cpu_group)
        dist.recv(buf, src=pp.prev_rank, group=pp.cpu_group)
        return tensors
    dist.recv(buf, src=pp.prev_rank, group=pp.cpu_group)
    dist.send(buf, dst=pp.next_rank, group=pp.cpu_group)
    return None


def raw_hop(rank: Rank, tensors: dict[str, torch.Tensor], lanes: bool) -> Any:
    """The same bytes with bare isend/irecv (+ all-gather) into preallocated tensors."""
    pp, tp = rank.groups.pp, rank.groups.tp
    peer = pp.next_rank  # two stages: next = previous
    n = tp.world_size if lanes else 1

    def part(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1)
        size = flat.numel() // n
        return flat.narrow(0, tp.rank_in_group * size, size) if lanes else flat

    def move(send: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        out = {k: torch.empty_like(tensors[k]) for k in KEYS}
        works = []
        for k in KEYS:
            if send is not None:
                works.append(
                    dist.isend(part(send[k]).contiguous(), dst=peer, group=pp.device_group)
                )
            else:
                buf = torch.empty_like(part(out[k]))
                works.append(dist.irecv(buf, src=peer, group=pp.device_group))
                out[k] = buf if lanes else buf.view(tensors[k].shape)
        for w in works:
            if w is not None:  # None: this rank is not in the group
                w.wait()
        if send is None and lanes:
            for k in KEYS:
                full = torch.empty_like(tensors[k])
                all_gather_into_tensor(full.view(-1), out[k], group=tp.device_group)
                out[k] = full
        return out

    if rank.stage == 0:
        move(tensors)
        got = move(None)
        rank.sync()
        return got
    got = move(None)
    move(got)
    rank.sync()
    return None


def gather_hop(rank: Rank, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """All-gather each tensor from equal slices: over TP, or the PP pair at TP = 1."""
    group = rank.groups.tp if rank.groups.tp.world_size > 1 else rank.groups.pp
    n, me = group.world_size, group.rank_in_group
    got = {}
    for k in KEYS:
        flat = tensors[k].reshape(-1)
        size = flat.numel() // n
        full = torch.empty_like(tensors[k])
        all_gather_into_tensor(
            full.view(-1), flat.narrow(0, me * size, size), group=group.device_group
        )
        got[k] = full
    rank.sync()
    return got


async def time_mode(rank: Rank, mode: str, tokens: int, args: argparse.Namespace) -> Row:
    """Per repeat, ``--iters`` hops back to back after one barrier (each hop
    waits for the last, so the two stages keep each other in step and the
    barrier's exit skew is paid once); the figure is the median repeat's
    time per one-way hop."""
    dtype = torch.bfloat16 if rank.device.type == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(tokens)  # the same tensors on every TP rank
    tensors = {
        k: torch.randn(tokens, args.hidden, generator=gen).to(rank.device, dtype) for k in KEYS
    }
    lanes = mode.startswith("lane")
    step = 0
    phases = Phases()

    def raw_batch(n: int) -> Any:
        got = None
        for _ in range(n):
            if mode == "gather_raw":
                got = gather_hop(rank, tensors)
            elif mode == "meta_raw":
                got = meta_hop(rank, tensors)
            else:
                got = raw_hop(rank, tensors, lanes)
        return got

    async def batch(n: int) -> Any:
        nonlocal step
        if mode.endswith("_raw"):
            return await trio.to_thread.run_sync(raw_batch, n)
        got = None
        for _ in range(n):
            got = await channel_hop(rank, tensors, step, lanes, phases)
            step += 1
        return got

    got = await batch(args.warmup)
    correct = rank.stage != 0 or all(torch.equal(got[k], tensors[k]) for k in KEYS)
    times = []
    for _ in range(args.repeats):
        await trio.to_thread.run_sync(rank.barrier)
        start = time.perf_counter()
        await batch(args.iters)
        hops = args.iters * (1 if mode == "gather_raw" else 2)  # a round trip is two hops
        times.append((time.perf_counter() - start) / hops * 1e6)
    nbytes = 2 * tokens * args.hidden * tensors[KEYS[0]].element_size()
    return {
        "mode": mode,
        "tokens": tokens,
        "bytes": nbytes,
        "one_way_us": statistics.median(times),
        "repeats_us": times,
        "correct": correct,
        "phases_us": phases.medians() or None,  # this rank's (stage 0's), channel modes
    }


def p2p_bandwidth(rank: Rank, nbytes: int = 256 << 20, repeats: int = 5) -> float | None:
    """Bytes/s of one large send from stage 0 lane 0 to stage 1 lane 0 (CUDA)."""
    if rank.device.type != "cuda":
        return None
    pp, tp = rank.groups.pp, rank.groups.tp
    buf = torch.empty(nbytes, dtype=torch.uint8, device=rank.device)
    best = float("inf")
    for _ in range(repeats):
        rank.barrier()
        start = time.perf_counter()
        if tp.rank_in_group == 0:
            op: Callable[..., Any] = dist.isend if rank.stage == 0 else dist.irecv
            peer = {"dst": pp.next_rank} if rank.stage == 0 else {"src": pp.prev_rank}
            op(buf, group=pp.device_group, **peer).wait()
            rank.sync()
        best = min(best, time.perf_counter() - start)
    rank.barrier()
    return nbytes / best if rank.stage == 1 and tp.rank_in_group == 0 else None


async def serve(rank: Rank, args: argparse.Namespace) -> tuple[list[Row], float | None]:
    rows = []
    async with trio.open_nursery() as sends:
        rank.sends = sends
        for tokens in args.tokens:
            for mode in args.modes:
                rows.append(await time_mode(rank, mode, tokens, args))
    bandwidth = await trio.to_thread.run_sync(p2p_bandwidth, rank)
    return rows, bandwidth


def worker(rank_id: int, args: argparse.Namespace, gpus: list[int], queue: Any) -> None:
    torch.set_num_threads(1)
    if args.switch_interval > 0:
        sys.setswitchinterval(args.switch_interval)
    device = torch.device("cuda", gpus[rank_id]) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    groups = init_distributed(
        rank=rank_id,
        world_size=len(gpus),
        tp_size=args.tp,
        pp_size=args.pp,
        init_method=f"tcp://127.0.0.1:{args.port}",
        backend="nccl" if device.type == "cuda" else "gloo",
    )
    barrier = dist.new_group(list(range(len(gpus))), backend="gloo")
    rank = Rank(groups, device, barrier)
    if args.profile is not None and rank_id in (0, args.tp):  # lane 0 of each stage
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        rows, bandwidth = profiler.runcall(trio.run, serve, rank, args)
        args.profile.mkdir(parents=True, exist_ok=True)
        with open(args.profile / f"stage{rank.stage}.txt", "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)
    else:
        rows, bandwidth = trio.run(serve, rank, args)
    queue.put((rank_id, rows, bandwidth))
    dist.barrier(group=barrier)
    dist.destroy_process_group()


# -- report ---------------------------------------------------------------------


def floors(row: Row, tp: int, bandwidth: float | None) -> float | None:
    if bandwidth is None:
        return None
    nbytes = row["bytes"]
    on_link = nbytes / tp + nbytes * (tp - 1) / tp if row["mode"].startswith("lane") else nbytes
    return on_link / bandwidth * 1e6


def report(rows: list[Row], args: argparse.Namespace, bandwidth: float | None) -> None:
    by = {(r["tokens"], r["mode"]): r for r in rows}
    print(f"{'tokens':>6} {'KiB':>8} " + " ".join(f"{m + ' us':>13}" for m in args.modes), end="")
    print(f" {'lane/whole':>10} {'floor lane':>10} {'floor whole':>11}")
    for tokens in args.tokens:
        cells = [by[(tokens, m)] for m in args.modes]
        line = f"{tokens:>6} {cells[0]['bytes'] / 1024:>8.0f} "
        line += " ".join(f"{c['one_way_us']:>13.1f}" for c in cells)
        lane, whole = by.get((tokens, "lane")), by.get((tokens, "whole"))
        ratio = lane["one_way_us"] / whole["one_way_us"] if lane and whole else float("nan")
        fl = floors({"bytes": cells[0]["bytes"], "mode": "lane"}, args.tp, bandwidth)
        fw = floors({"bytes": cells[0]["bytes"], "mode": "whole"}, args.tp, bandwidth)
        line += f" {ratio:>10.2f} {fl or float('nan'):>10.1f} {fw or float('nan'):>11.1f}"
        print(line)
    bad = sorted({r["mode"] for r in rows if not r["correct"]})
    print(
        f"all received tensors equal the sent ones: {not bad}" + (f" (wrong: {bad})" if bad else "")
    )
    if bandwidth is not None:
        print(f"point-to-point bandwidth (one 256 MiB send, best of 5): {bandwidth / 1e9:.1f} GB/s")


def report_phases(rows: list[Row]) -> None:
    """Median host µs per phase of a channel hop, stage 0 then stage 1."""
    for row in rows:
        if not row.get("phases_us"):
            continue
        for stage, key in ((0, "phases_us"), (1, "phases_us_stage1")):
            cells = ", ".join(f"{k} {v:.0f}" for k, v in row[key].items())
            print(f"  {row['mode']} {row['tokens']} tokens, stage {stage}: {cells}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = now()
    world = args.tp * args.pp
    count = torch.cuda.device_count() if args.device == "cuda" else world
    gpus = rank_gpus(args.tp, args.pp, args.rank_gpus or count)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, gpus, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in range(world)]
    for p in procs:
        p.join(60)
    rows = next(rows for rank, rows, _ in results if rank == 0)
    stage1 = next(rows for rank, rows, _ in results if rank == args.tp)  # its lane 0
    bandwidth = next((bw for _, _, bw in results if bw is not None), None)
    for row, other in zip(rows, stage1, strict=True):
        row["floor_us"] = floors(row, args.tp, bandwidth)
        row["phases_us_stage1"] = other["phases_us"]
    report(rows, args, bandwidth)
    report_phases(rows)
    extra = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)",
        "layout": {"tp": args.tp, "pp": args.pp, "rank_gpus": gpus},
        "p2p_bandwidth_Bps": bandwidth,
    }
    cases = [row_case(row, ["tokens", "mode"]) for row in rows]
    write(
        record("pp_transfer", argv, started, options=vars(args), cases=cases, extra=extra), args.out
    )
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
