"""The persistent block table: each request row's KV block ids, and the
slot mapping derived from it (``slot = block_id * block_size + offset``)."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Block ids per request row, kept on the host; the runner copies the
    step's rows to the device (through its staging buffers)."""

    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        """Replace a row's blocks (a new request, or one resumed after preemption)."""
        self.num_blocks_per_row[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise RuntimeError(
                f"request needs {end} blocks, more than max_num_blocks_per_req "
                f"({self.max_num_blocks_per_req})"
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[dst, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[dst] = n

    def swap_row(self, a: int, b: int) -> None:
        n = int(max(self.num_blocks_per_row[a], self.num_blocks_per_row[b]))
        self.block_table_np[[a, b], :n] = self.block_table_np[[b, a], :n]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Slot of every token of the step, from its request row and position."""
        block_ids = self.block_table_np[req_indices, positions // self.block_size]
        return block_ids.astype(np.int64) * self.block_size + positions % self.block_size
