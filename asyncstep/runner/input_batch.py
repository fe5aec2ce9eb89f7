"""The persistent batch: per-request state the runner keeps across steps,
laid out in rows of host arrays that each step reads without rebuilding.

Requests join at a free row, leave a hole when they end, and ``condense``
moves the last rows into the holes so rows ``[0, num_reqs)`` are dense. Rows
are reordered decodes first before a step (``reorder_decodes_first``) so the
attention backend can treat all one-token queries as one batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncstep.datatypes import SamplingParams
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.sampler import SamplingMetadata


@dataclass
class CachedRequestState:
    """What the runner knows about one request."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size)
        self.sampling_params: list[SamplingParams | None] = []
        self.generators: dict[int, torch.Generator] = {}

    # -- membership -------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids of rows ``[0, num_reqs)`` (valid after ``condense``)."""
        ids = self._req_ids[: self.num_reqs]
        assert all(i is not None for i in ids), "condense() before reading req_ids"
        return ids  # type: ignore[return-value]

    def add_request(self, req: CachedRequestState) -> int:
        """Place a request at the first free row; returns the row."""
        try:
            row = self._req_ids.index(None)
        except ValueError:
            row = len(self._req_ids)
            if row >= self.max_num_reqs:
                raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)") from None
            self._req_ids.append(None)
            self.sampling_params.append(None)
        self._req_ids[row] = req.req_id
        self.req_id_to_index[req.req_id] = row
        n_prompt, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
        self.token_ids_cpu[row, :n_prompt] = req.prompt_token_ids
        self.token_ids_cpu[row, n_prompt : n_prompt + n_out] = req.output_token_ids
        self.num_tokens[row] = n_prompt + n_out
        self.num_computed_tokens_cpu[row] = req.num_computed_tokens
        self.block_table.add_row(req.block_ids, row)
        self.sampling_params[row] = req.sampling_params
        if req.generator is not None:
            self.generators[row] = req.generator
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Free a request's row (leaving a hole until ``condense``)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self.sampling_params[row] = None
        self.generators.pop(row, None)
        return row

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1

    # -- row moves --------------------------------------------------------

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None
        n = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        self.num_tokens[dst] = n
        self.num_computed_tokens_cpu[dst] = self.num_computed_tokens_cpu[src]
        self.block_table.move_row(src, dst)
        self._req_ids[dst], self._req_ids[src] = req_id, None
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        self.req_id_to_index[req_id] = dst
        if src in self.generators:
            self.generators[dst] = self.generators.pop(src)

    def condense(self) -> None:
        """Fill holes with the last rows so rows ``[0, num_reqs)`` are dense."""
        n = self.num_reqs
        holes = [row for row in range(n) if self._req_ids[row] is None]
        tail = [row for row in range(len(self._req_ids) - 1, n - 1, -1) if self._req_ids[row]]
        for hole, src in zip(holes, tail, strict=True):
            self._move_row(src, hole)
        del self._req_ids[n:]
        del self.sampling_params[n:]

    def swap_states(self, a: int, b: int) -> None:
        ia, ib = self._req_ids[a], self._req_ids[b]
        assert ia is not None and ib is not None
        n = int(max(self.num_tokens[a], self.num_tokens[b]))
        self.token_ids_cpu[[a, b], :n] = self.token_ids_cpu[[b, a], :n]
        for arr in (self.num_tokens, self.num_computed_tokens_cpu):
            arr[[a, b]] = arr[[b, a]]
        self.block_table.swap_row(a, b)
        self._req_ids[a], self._req_ids[b] = ib, ia
        self.req_id_to_index[ia], self.req_id_to_index[ib] = b, a
        sp = self.sampling_params
        sp[a], sp[b] = sp[b], sp[a]
        ga, gb = self.generators.pop(a, None), self.generators.pop(b, None)
        if gb is not None:
            self.generators[a] = gb
        if ga is not None:
            self.generators[b] = ga

    def reorder_decodes_first(self, num_scheduled_tokens: dict[str, int]) -> int:
        """Move one-token requests to the front; returns how many there are."""
        ids = self.req_ids
        is_decode = [num_scheduled_tokens[r] == 1 for r in ids]
        num_decodes = sum(is_decode)
        front, back = 0, len(ids) - 1
        while True:
            while front < len(ids) and is_decode[front]:
                front += 1
            while back >= 0 and not is_decode[back]:
                back -= 1
            if front >= num_decodes or back < num_decodes:
                return num_decodes
            self.swap_states(front, back)
            is_decode[front], is_decode[back] = True, False

    # -- sampling ---------------------------------------------------------

    def sampling_metadata(self, rows: list[int]) -> SamplingMetadata:
        """Sampling parameters of the given rows, in that order."""
        params = [self.sampling_params[row] for row in rows]
        assert all(p is not None for p in params)
        generators = {
            i: self.generators[row] for i, row in enumerate(rows) if row in self.generators
        }
        return SamplingMetadata.from_params(params, generators, self.device)  # type: ignore[arg-type]
