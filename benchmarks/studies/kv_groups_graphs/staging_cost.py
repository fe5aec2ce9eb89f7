"""Host cost of a graph step's inputs with several KV cache groups: a steady
decode step's host inputs (every group's slots and block table views) and
their staging into the graph runner's static buffers, for 1, 2 (gpt-oss)
and 13 (gemma3-1b) groups, batch 1 and 32, rows of 2048 tokens in blocks of
16, interleaved in one process (medians of rounds; ratios against one group):
the step inputs' host arrays (``StepInputBuilder``'s, which an eager step
builds too) apart from the graph runner's staging (``load_inputs``).

    PYTHONPATH=$PWD nice -n 19 python3 benchmarks/studies/kv_groups_graphs/staging_cost.py

On the CPU the static buffers are the host arrays (no upload): this is the
host's share (numpy), which a CUDA step pays before its one upload."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import load_model
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.cudagraph_dispatcher import (
    BatchDescriptor,
    CudagraphDispatcher,
    CUDAGraphMode,
)
from asyncstep.runner.cudagraph_runner import CudaGraphRunner, HostInputs

BLOCK, MAX_LEN, MAX_REQS = 16, 2048, 64


def step_inputs(table: BlockTable, positions: np.ndarray) -> HostInputs:
    """A decode step's host inputs as ``StepInputBuilder`` builds them."""
    r, groups = len(positions), table.num_groups
    return HostInputs(
        input_ids=np.ones(r, dtype=np.int64),
        positions=positions,
        slot_mapping=table.decode_slot_mapping(positions),
        query_start_loc=np.arange(r + 1, dtype=np.int32),
        seq_lens=(positions + 1).astype(np.int32),
        block_table=table.group_table(0, r),
        block_table_source=table,
        group_slot_mappings=list(table.decode_group_slot_mappings(positions)),
        group_block_tables=[table.group_table(g, r) for g in range(1, groups)],
    )


def setup(model: object, groups: int, batch: int) -> tuple[CudaGraphRunner, BlockTable]:
    dispatcher = CudagraphDispatcher(
        CUDAGraphMode.FULL_AND_PIECEWISE, max_num_seqs=MAX_REQS, max_num_batched_tokens=512
    )
    blocks = MAX_LEN // BLOCK
    runner = CudaGraphRunner(
        model,  # type: ignore[arg-type]
        dispatcher,
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_num_reqs=MAX_REQS,
        max_blocks_per_req=blocks,
        num_kv_groups=groups,
        stand_in=True,
    )
    return runner, BlockTable(MAX_REQS, blocks, BLOCK, num_groups=groups)


def fill(table: BlockTable, batch: int) -> None:
    """Rows of 1024 tokens: 64 random blocks a group."""
    rng = np.random.default_rng(0)
    for row in range(batch):
        table.add_row(rng.integers(1, 100000, 64 * table.num_groups).tolist(), row)


def one_step(
    runner: CudaGraphRunner, table: BlockTable, positions: np.ndarray
) -> tuple[float, float]:
    """Seconds to build the step's host inputs, and to stage them (``load_inputs``)."""
    t0 = time.perf_counter()
    host = step_inputs(table, positions)
    t1 = time.perf_counter()
    desc = runner.dispatcher.dispatch(len(positions), len(positions), True)[1]
    runner.load_inputs(desc if desc.num_reqs else BatchDescriptor(len(positions)), host, None)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    model = load_model(ModelConfig(model="tiny-llama", load_format="dummy", device="cpu")).model
    for batch in (1, 32):
        cases = {g: setup(model, g, batch) for g in (1, 2, 13)}
        times: dict[int, list[tuple[float, float]]] = {g: [] for g in cases}
        for _ in range(args.rounds):
            for g, (runner, table) in cases.items():  # interleaved
                fill(table, batch)
                positions = np.full(batch, 1000, dtype=np.int64)
                build = stage = 0.0
                for step in range(args.steps):
                    if step % BLOCK == 0:  # a new block every 16 steps (every row, every group)
                        for row in range(batch):
                            table.append_row([5] * g, row)
                    b, s = one_step(runner, table, positions + step)
                    build, stage = build + b, stage + s
                times[g].append((build / args.steps, stage / args.steps))
        base = [statistics.median(t[i] for t in times[1]) for i in (0, 1)]
        for g, ts in times.items():
            build, stage = (statistics.median(t[i] for t in ts) for i in (0, 1))
            print(
                f"batch {batch:2d}, {g:2d} groups: host inputs {build * 1e6:6.1f} us "
                f"({build / base[0]:.2f}x), load_inputs {stage * 1e6:6.1f} us "
                f"({stage / base[1]:.2f}x)"
            )


if __name__ == "__main__":
    main()
