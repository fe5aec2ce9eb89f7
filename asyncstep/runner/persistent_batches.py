"""The runner's persistent batches and request states, kept up to date from
each step's :class:`~asyncstep.datatypes.SchedulerOutput`:
:class:`PersistentBatches`.

Each step the runner selects the batch that holds most of the step's requests
(:meth:`PersistentBatches.select`; more than one batch with pipeline
parallelism) and applies the step's diffs to it (:meth:`~PersistentBatches.update`):
finished requests dropped, unscheduled ones out of the batch (their state
stays), new ones in, the cached ones' counts, blocks and tokens updated, rows
dense and decodes first. A request's row, not its state, holds its tokens
while it has one (see :class:`~asyncstep.runner.input_batch.CachedRequestState`).

With ``fast_paths`` the update spends Python only on the requests that got a
new block, joined, left or resumed: the computed counts of the requests that
keep their rows are one array assignment, and their rows are remembered
while the ids and the batch's layout stay the same. Off, request by request
(tests compare the two).

May import numpy, torch, ``asyncstep.datatypes`` and the runner's
``input_batch`` and ``step_inputs`` modules; not the model runner.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import torch

from asyncstep.datatypes import CachedRequestData, NewRequestData, SchedulerOutput
from asyncstep.runner.input_batch import CachedRequestState, InputBatch
from asyncstep.runner.step_inputs import is_arange


class PersistentBatches:
    """The requests' states and the persistent batches holding their rows."""

    def __init__(
        self,
        num_input_batches: int,
        *,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        is_last_stage: bool,
        num_kv_cache_groups: int = 1,
    ) -> None:
        """``num_input_batches``: batches kept (pipeline parallelism: one per
        step in flight, whose requests differ, so alternating steps do not
        rebuild every row each step). ``is_last_stage``: this stage samples
        (it appends its sampled tokens itself; other stages get them in the
        scheduler output). ``num_kv_cache_groups``: the block ids come
        interleaved by group (:mod:`asyncstep.kv_cache_interface`)."""
        if num_input_batches < 1:
            raise ValueError(f"num_input_batches must be >= 1, got {num_input_batches}")
        self.device = device
        self.is_last_stage = is_last_stage
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batches = [
            InputBatch(max_num_reqs, max_model_len, block_size, device, num_kv_cache_groups)
            for _ in range(num_input_batches)
        ]
        #: The persistent batch of the current step.
        self.input_batch = self.input_batches[0]
        #: Off: every update request by request (see the module doc).
        self.fast_paths = True
        #: The last steady step's cached request ids and their rows (None:
        #: row i is request i), valid while the batch's layout is the same.
        self._steady_rows: tuple[InputBatch, int, list[str], np.ndarray | None] | None = None

    def select(self, so: SchedulerOutput) -> InputBatch:
        """Make the current batch the one holding most of this step's
        requests (an emptier one on a tie, e.g. a step of new requests);
        returns it."""
        if len(self.input_batches) == 1:
            return self.input_batch
        scheduled = so.num_scheduled_tokens

        def fit(batch: InputBatch) -> tuple[int, int]:
            return sum(r in scheduled for r in batch.req_id_to_index), -batch.num_reqs

        self.input_batch = max(self.input_batches, key=fit)
        return self.input_batch

    def update(self, so: SchedulerOutput) -> None:
        """The current batch from the step's diffs (see the module doc)."""
        batch = self.input_batch
        if not self.fast_paths:
            self._update_one_by_one(so)
            return
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._remove_everywhere(req_id, finished=True)
        scheduled, index = so.num_scheduled_tokens, batch.req_id_to_index
        same = len(scheduled) == len(index) and scheduled.keys() == index.keys()
        if not same:
            for req_id in index.keys() - scheduled.keys():
                batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self._add_state(new)
        self._update_cached_bulk(so.scheduled_cached_reqs)
        if len(index) != len(scheduled):  # (index holds only scheduled requests now)
            for req_id in [r for r in scheduled if r not in index]:
                self._remove_everywhere(req_id)  # a request lives in one batch
                batch.add_request(self.requests[req_id])
        batch.condense()
        if so.total_num_scheduled_tokens != batch.num_reqs:  # else: all decodes
            batch.reorder_decodes_first(scheduled)

    def _update_one_by_one(self, so: SchedulerOutput) -> None:
        """``update`` request by request (``fast_paths`` off)."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._remove_everywhere(req_id, finished=True)
        for req_id in list(batch.req_id_to_index):
            if req_id not in so.num_scheduled_tokens:
                batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            self._add_state(new)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._update_cached(
                self.requests[req_id],
                resumed=cached.resumed_from_preemption[i],
                new_block_ids=cached.new_block_ids[i],
                new_token_ids=cached.new_token_ids[i] if cached.new_token_ids else [],
                num_computed_tokens=cached.num_computed_tokens[i],
            )
        for req_id in so.num_scheduled_tokens:
            if req_id not in batch.req_id_to_index:
                self._remove_everywhere(req_id)
                batch.add_request(self.requests[req_id])
        batch.condense()
        if so.total_num_scheduled_tokens != batch.num_reqs:
            batch.reorder_decodes_first(so.num_scheduled_tokens)

    def _remove_everywhere(self, req_id: str, *, finished: bool = False) -> None:
        for batch in self.input_batches:
            batch.remove_request(req_id, sync_state=not finished)

    def _add_state(self, new: NewRequestData) -> None:
        params = new.sampling_params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.requests[new.req_id] = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=params,
            generator=generator,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
        )

    def _update_cached_bulk(self, cached: CachedRequestData) -> None:
        """``_update_cached`` of every cached request, at once for those in
        their row (not resumed; this stage samples, so no tokens to append):
        one array assignment of the computed counts, and Python only for the
        requests that got new blocks. The rest one by one."""
        req_ids = cached.req_ids
        num = len(req_ids)
        if num == 0:
            return
        rows: np.ndarray | None
        if not self.is_last_stage:  # tokens for every request: one by one
            rows = np.full(num, -1, dtype=np.int64)
        else:
            rows = self._cached_rows(req_ids)
        one_by_one = None if rows is None else rows < 0
        if any(cached.resumed_from_preemption):
            resumed = np.fromiter(cached.resumed_from_preemption, bool, num)
            one_by_one = resumed if one_by_one is None else one_by_one | resumed
        batch = self.input_batch
        computed = batch.num_computed_tokens_cpu
        new_block_ids = cached.new_block_ids
        if one_by_one is None or not one_by_one.any():  # every request in its row
            if rows is None:  # request i in row i
                computed[:num] = cached.num_computed_tokens
            else:
                computed[rows] = cached.num_computed_tokens
            if any(new_block_ids):
                self._append_blocks(cached, range(num), rows)
            return
        if rows is None:
            rows = np.arange(num)
        in_row = np.flatnonzero(~one_by_one)
        rows_in = rows[in_row]
        computed[rows_in] = np.asarray(cached.num_computed_tokens)[in_row]
        if any(new_block_ids):
            with_blocks = itertools.compress(range(num), new_block_ids)
            self._append_blocks(cached, [i for i in with_blocks if not one_by_one[i]], rows)
        for i in np.flatnonzero(one_by_one).tolist():
            self._update_cached(
                self.requests[req_ids[i]],
                resumed=cached.resumed_from_preemption[i],
                new_block_ids=new_block_ids[i],
                new_token_ids=cached.new_token_ids[i] if cached.new_token_ids else [],
                num_computed_tokens=cached.num_computed_tokens[i],
            )

    def _append_blocks(
        self, cached: CachedRequestData, which: Iterable[int], rows: np.ndarray | None
    ) -> None:
        """The new blocks of the cached requests ``which`` (indices into
        ``cached``), in their rows (None: request i in row i)."""
        new_block_ids, table = cached.new_block_ids, self.input_batch.block_table
        for i in itertools.compress(which, map(new_block_ids.__getitem__, which)):
            blocks = new_block_ids[i]
            self.requests[cached.req_ids[i]].block_ids.extend(blocks)
            table.append_row(blocks, i if rows is None else int(rows[i]))

    def _cached_rows(self, req_ids: list[str]) -> np.ndarray | None:
        """The batch row of each of ``req_ids`` (-1: not in the batch); None
        when request i is in row i. Remembered while the ids and the batch's
        layout stay the same (a steady step: no Python per request)."""
        batch = self.input_batch
        last = self._steady_rows
        if (
            last is not None
            and last[0] is batch
            and last[1] == batch.layout_version
            and last[2] == req_ids
        ):
            return last[3]
        rows = np.fromiter(
            map(batch.req_id_to_index.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids)
        )
        found = None if len(rows) == batch.num_reqs and is_arange(rows) else rows
        self._steady_rows = (batch, batch.layout_version, list(req_ids), found)
        return found

    def _update_cached(
        self,
        state: CachedRequestState,
        *,
        resumed: bool,
        new_block_ids: list[int],
        new_token_ids: list[int],
        num_computed_tokens: int,
    ) -> None:
        row = self.input_batch.req_id_to_index.get(state.req_id)
        if resumed or row is None:
            # Re-added whole by update (a resumed request's row, if any, is
            # stale): first its state catches up with a row it has in any
            # batch, then takes this step's deltas.
            self._remove_everywhere(state.req_id)
            row = None
        state.num_computed_tokens = num_computed_tokens
        if self.is_last_stage:
            new_token_ids = []  # this stage sampled them itself
        # Tokens sampled by the last pipeline stage, which this stage needs as inputs.
        state.output_token_ids.extend(new_token_ids)
        if resumed:
            state.block_ids = list(new_block_ids)
        else:
            state.block_ids.extend(new_block_ids)
        if row is None:
            return
        self.input_batch.num_computed_tokens_cpu[row] = num_computed_tokens
        for token in new_token_ids:
            self.input_batch.append_token(row, token)
        self.input_batch.block_table.append_row(new_block_ids, row)
