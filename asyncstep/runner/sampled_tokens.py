"""The sampled-token bookkeeping of the runner: :class:`SampledTokens`.

A step's sampled ids stay on the device (the newest step's, with where they
came from); with async scheduling the next step, which the scheduler built
before it knew them (output placeholders), scatters them into its input ids
(:meth:`SampledTokens.scatter`). Their copies to the host are kept
(:meth:`~SampledTokens.keep`) until a later step starts
(:meth:`~SampledTokens.resolve`: by then the copy has long landed); then
their tokens are appended to the persistent batch at the rows the requests
hold now, or to the states of those that left it (a finished one's nowhere).
The synchronous runner appends them at once (:meth:`~SampledTokens.apply`).

With ``fast_paths`` the tokens are appended with a few array operations when
there are many (no row changed hands since the sampling, or one persistent
batch), and the steady decode step (the same requests in the same rows, one
token each) copies the previous ids into its input ids without a gather.
Off, token by token (tests compare the two).

May import numpy, torch and the runner's ``async_output``,
``input_batch``, ``persistent_batches``, ``staging`` and ``step_inputs``
modules; not the model runner.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.runner.async_output import AsyncModelRunnerOutput
from asyncstep.runner.input_batch import InputBatch
from asyncstep.runner.persistent_batches import PersistentBatches
from asyncstep.runner.staging import StagingBuffers
from asyncstep.runner.step_inputs import is_arange

#: Up to this many sampled rows, tokens are appended one by one.
_FEW_ROWS = 32


@dataclass
class _SampledFrom:
    """Where a step's sampled ids came from: its batch, the batch's layout
    then, the row of each sampled id, and the rows' request ids."""

    batch: InputBatch
    layout_version: int
    rows: list[int]
    req_ids: list[str]

    def still_in_place(self) -> bool:
        """Whether every row still holds the request it held then."""
        return self.batch.layout_version == self.layout_version

    def all_rows(self) -> bool:
        """Whether every row of the batch sampled (rows are 0, 1, ...)."""
        return len(self.rows) == len(self.req_ids)

    def index(self) -> dict[str, int]:
        """Request id -> its id's index in the sampled ids."""
        ids = map(self.req_ids.__getitem__, self.rows)
        return dict(zip(ids, range(len(self.rows)), strict=True))


class SampledTokens:
    """The newest sampled ids on the device, and the sampled outputs whose
    tokens the persistent batches do not hold yet."""

    def __init__(self, batches: PersistentBatches, staging: StagingBuffers) -> None:
        self._batches = batches
        self._staging = staging
        #: Off: tokens appended one by one, ids always gathered (see the module doc).
        self.fast_paths = True
        #: The last sampled ids, still on the device, and whose they are.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_sampled_from: _SampledFrom | None = None
        #: Sampled outputs whose tokens the persistent batch does not hold yet.
        self._unresolved: deque[tuple[AsyncModelRunnerOutput, _SampledFrom | None]] = deque()

    def record(
        self, sampled: torch.Tensor, batch: InputBatch, rows: list[int], req_ids: list[str]
    ) -> None:
        """The step's sampled ids, one per row of ``rows`` of ``batch``
        (whose request ids are ``req_ids``)."""
        self._prev_sampled = sampled
        self._prev_sampled_from = _SampledFrom(batch, batch.layout_version, rows, req_ids)

    def clear(self) -> None:
        """The step sampled no ids."""
        self._prev_sampled, self._prev_sampled_from = None, None

    def keep(self, output: AsyncModelRunnerOutput) -> None:
        """The output of the step last recorded, its tokens for ``resolve``."""
        self._unresolved.append((output, self._prev_sampled_from))

    def apply(self, output: AsyncModelRunnerOutput) -> None:
        """The tokens of the step last recorded to the persistent batch now."""
        self._apply(output, self._prev_sampled_from)

    def resolve(self, *, keep_last: bool) -> None:
        """Append the tokens of kept outputs to the persistent batch; all of
        them, or all but the newest (whose ids the next step takes from the
        device, even when its copy has landed: one code path on every device).
        A speculative step's output is always appended (no step takes ids of
        it from the device). Blocks on a copy only if it has not landed yet."""
        unresolved = self._unresolved
        keep = 1 if keep_last and unresolved and not unresolved[-1][0].multi_token else 0
        while len(unresolved) > keep:
            self._apply(*unresolved.popleft())

    def _apply(self, output: AsyncModelRunnerOutput, origin: _SampledFrom | None) -> None:
        batches = self._batches
        if output.multi_token:  # a speculative step: 1 + accepted tokens per row
            self._append_lists(output)
            return
        if self.fast_paths and origin is not None:
            if origin.still_in_place():
                _append_in_place(output, origin)
                return
            if len(batches.input_batches) == 1 and len(origin.rows) > _FEW_ROWS:
                self._append_moved(output, origin)
                return
        requests, input_batches = batches.requests, batches.input_batches
        tokens = output.sampled_token_ids()
        for row, token in zip(output.sample_rows, tokens, strict=True):
            req_id = output.req_ids[row]
            state = requests.get(req_id)
            if state is None:
                continue  # finished meanwhile
            for batch in input_batches:  # a request is in one batch at most
                current_row = batch.req_id_to_index.get(req_id)
                if current_row is not None:
                    batch.append_token(current_row, token)
                    break
            else:
                state.output_token_ids.append(token)  # (its row, if any, has it)

    def _append_lists(self, output: AsyncModelRunnerOutput) -> None:
        """``_apply`` of a step whose rows may have several tokens each: to
        the rows the requests hold now, or to their states."""
        requests, input_batches = self._batches.requests, self._batches.input_batches
        for row, tokens in zip(output.sample_rows, output.sampled_token_lists(), strict=True):
            req_id = output.req_ids[row]
            state = requests.get(req_id)
            if state is None:
                continue  # finished meanwhile
            for batch in input_batches:
                current_row = batch.req_id_to_index.get(req_id)
                if current_row is not None:
                    for token in tokens:
                        batch.append_token(current_row, token)
                    break
            else:
                state.output_token_ids.extend(tokens)

    def _append_moved(self, output: AsyncModelRunnerOutput, origin: _SampledFrom) -> None:
        """``_apply`` with one persistent batch whose rows changed since the
        sampling: the tokens of the requests still in it at once (at their
        rows now), the others' to their states (a finished one's nowhere)."""
        batch = self._batches.input_batch
        req_ids = [origin.req_ids[row] for row in origin.rows]
        rows = np.fromiter(
            map(batch.req_id_to_index.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids)
        )
        tokens = output.sampled_token_array()
        present = rows >= 0
        if present.all():
            batch.append_tokens(rows, tokens)
            return
        batch.append_tokens(rows[present], tokens[present])
        requests = self._batches.requests
        for i in np.flatnonzero(~present).tolist():
            state = requests.get(req_ids[i])
            if state is not None:
                state.output_token_ids.append(int(tokens[i]))

    def scatter(
        self,
        input_ids: torch.Tensor,
        seq_lens: np.ndarray,
        cu_num_tokens: np.ndarray,
    ) -> torch.Tensor:
        """Fill the tokens whose ids only the device knows (sampled by the
        previous step, async scheduling) from the sampled ids left there.
        Such a token is its request's last of this step."""
        batch = self._batches.input_batch
        num_reqs = batch.num_reqs
        unknown = seq_lens > batch.num_tokens[:num_reqs]
        if not unknown.any():
            return input_ids
        origin, prev = self._prev_sampled_from, self._prev_sampled
        if (
            self.fast_paths
            and origin is not None
            and prev is not None
            and origin.batch is batch
            and origin.still_in_place()
            and origin.all_rows()
            and int(cu_num_tokens[-1]) == num_reqs
            and unknown.all()
        ):
            # Steady decode: the same requests in the same rows, one token each.
            input_ids[:num_reqs].copy_(prev[:num_reqs])
            return input_ids
        rows = np.flatnonzero(unknown)
        req_ids = list(map(batch.req_ids.__getitem__, rows.tolist()))
        index = origin.index() if origin is not None else {}
        src = np.fromiter(map(index.get, req_ids, itertools.repeat(-1)), np.int64, len(req_ids))
        if prev is None or (src < 0).any():
            missing = [r for r in req_ids if r not in index]
            raise RuntimeError(
                f"step computes tokens that were never sampled (requests {missing}): "
                "a placeholder without a sampled id"
            )
        dst = (cu_num_tokens[rows] - 1).astype(np.int64)
        if is_arange(src) and is_arange(dst):
            # The same requests in the same order, one token each.
            input_ids[: len(src)].copy_(prev[: len(src)])
            return input_ids
        to_device = self._staging.to_device
        dst_t, src_t = to_device("scatter_dst", dst), to_device("scatter_src", src)
        input_ids.index_copy_(0, dst_t, prev.index_select(0, src_t))
        return input_ids


def _append_in_place(output: AsyncModelRunnerOutput, origin: _SampledFrom) -> None:
    """``SampledTokens._apply`` when no row changed hands since the sampling
    (no request left, so none finished meanwhile): each token to its row, all
    at once when there are many (a few array operations cost more than a few
    scalar ones)."""
    batch = origin.batch
    if len(origin.rows) <= _FEW_ROWS:
        for row, token in zip(origin.rows, output.sampled_token_ids(), strict=True):
            batch.append_token(row, token)
        return
    rows = None if origin.all_rows() else np.asarray(origin.rows)
    batch.append_tokens(rows, output.sampled_token_array())
