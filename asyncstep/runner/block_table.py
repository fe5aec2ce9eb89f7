"""The persistent block table: each request row's KV block ids, and the
slot mapping derived from it (``slot = block_id * block_size + offset``).

Rows whose blocks changed (a new request, a new block, a row moved) are
marked dirty until :meth:`BlockTable.take_dirty_rows`: a consumer that keeps
its own copy of the table (the CUDA-graph runner's staged inputs) then
rewrites only those rows.

With several KV cache groups (:mod:`asyncstep.kv_cache_interface`) a row
holds the groups' block ids interleaved, as the scheduler sends them: group
``g``'s table is the columns ``g::num_groups`` (:meth:`BlockTable.group_table`),
and its slots come from those columns."""

from __future__ import annotations

import numpy as np


class BlockTable:
    """Block ids per request row, kept on the host; the runner copies the
    step's rows to the device (through its staging buffers)."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        block_size: int,
        num_groups: int = 1,
    ) -> None:
        """``max_num_blocks_per_req``: of one group."""
        self.block_size = block_size
        self.num_groups = num_groups
        max_num_blocks_per_req *= num_groups
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        #: The table row-major, flat (a view): ``row * max_num_blocks_per_req + block``.
        self._flat = self.block_table_np.reshape(-1)
        assert np.shares_memory(self._flat, self.block_table_np)
        #: ``row * max_num_blocks_per_req``: where each row starts in ``_flat``.
        self._row_starts = np.arange(max_num_reqs, dtype=np.int64) * max_num_blocks_per_req
        #: Rows changed since the last ``take_dirty_rows``.
        self._dirty: set[int] = set()

    def add_row(self, block_ids: list[int], row: int) -> None:
        """Replace a row's blocks (a new request, or one resumed after preemption)."""
        self.num_blocks_per_row[row] = 0
        self._dirty.add(row)
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
        self._dirty.add(row)

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[dst, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[dst] = n
        self._dirty.add(dst)

    def swap_row(self, a: int, b: int) -> None:
        n = int(max(self.num_blocks_per_row[a], self.num_blocks_per_row[b]))
        self.block_table_np[[a, b], :n] = self.block_table_np[[b, a], :n]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]
        self._dirty.update((a, b))

    def group_table(self, group: int, num_rows: int) -> np.ndarray:
        """Group ``group``'s block ids of rows ``[0, num_rows)`` (the whole
        table with one group; a strided view with several)."""
        if self.num_groups == 1:
            return self.block_table_np[:num_rows]
        return self.block_table_np[:num_rows, group :: self.num_groups]

    def take_dirty_rows(self, num_rows: int) -> list[int]:
        """Rows below ``num_rows`` changed since the last call (ascending),
        and forget every mark (a row at or above ``num_rows`` is marked
        again when a request takes it)."""
        if not self._dirty:
            return []
        rows = sorted(row for row in self._dirty if row < num_rows)
        self._dirty.clear()
        return rows

    def compute_slot_mapping(
        self, req_indices: np.ndarray, positions: np.ndarray, group: int = 0
    ) -> np.ndarray:
        """Slot of every token of the step (in KV cache group ``group``),
        from its request row and position."""
        column = positions // self.block_size
        if self.num_groups > 1:
            column = column * self.num_groups + group
        block_ids = self.block_table_np[req_indices, column]
        return block_ids.astype(np.int64) * self.block_size + positions % self.block_size

    def decode_slot_mapping(self, positions: np.ndarray, group: int = 0) -> np.ndarray:
        """:meth:`compute_slot_mapping` when token ``i`` is row ``i``'s (a
        step of one-token queries), in fewer array operations."""
        block_index, offset = np.divmod(positions, self.block_size)
        if self.num_groups > 1:
            block_index = block_index * self.num_groups + group
        block_index += self._row_starts[: len(positions)]
        slots = self._flat.take(block_index).astype(np.int64)
        slots *= self.block_size
        slots += offset
        return slots

    def decode_group_slot_mappings(self, positions: np.ndarray) -> np.ndarray:
        """:meth:`decode_slot_mapping` of groups ``1 ..`` in one pass:
        ``[num_groups - 1, len(positions)]`` (row ``g - 1``: group ``g``'s)."""
        block_index, offset = np.divmod(positions, self.block_size)
        block_index = block_index * self.num_groups + self._row_starts[: len(positions)]
        columns = block_index + np.arange(1, self.num_groups)[:, None]
        slots = self._flat.take(columns).astype(np.int64)
        slots *= self.block_size
        slots += offset
        return slots
