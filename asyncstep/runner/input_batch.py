"""The persistent batch: per-request state the runner keeps across steps,
laid out in rows of host arrays that each step reads without rebuilding.

Requests join at a free row, leave a hole when they end, and ``condense``
moves the last rows into the holes so rows ``[0, num_reqs)`` are dense. Rows
are reordered decodes first before a step (``reorder_decodes_first``) so the
attention backend can treat all one-token queries as one batch.

``layout_version`` changes whenever a row changes hands (a request joins,
leaves or moves): while it holds, every row is the same request as before,
which lets a step of the same requests skip the per-request work (the
runner's steady decode path, the cached sampling metadata).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncstep.datatypes import SamplingParams
from asyncstep.runner.block_table import BlockTable
from asyncstep.runner.logits_processing import LogitsProcessing, TokenHistory, to_device
from asyncstep.runner.sampler import SamplingMetadata


@dataclass
class CachedRequestState:
    """What the runner knows about one request.

    While the request holds a batch row, the row is the current record of
    its tokens and computed count (a step appends to the row only):
    ``num_computed_tokens`` and ``output_token_ids`` catch up when it leaves
    the row (:meth:`InputBatch.remove_request`), before they are read again
    (a request joins a row from its state)."""

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
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self._req_ids: list[str | None] = []
        #: Each row's request state (parallel to ``_req_ids``).
        self._states: list[CachedRequestState | None] = []
        self.req_id_to_index: dict[str, int] = {}
        #: Bumped whenever a row changes hands (see the module doc).
        self.layout_version = 0
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        #: ``token_ids_cpu`` flat (a view): ``row * max_model_len + position``.
        self.token_ids_flat = self.token_ids_cpu.reshape(-1)
        assert np.shares_memory(self.token_ids_flat, self.token_ids_cpu)
        self._rows = np.arange(max_num_reqs)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = BlockTable(
            max_num_reqs, -(-max_model_len // block_size), block_size, num_kv_cache_groups
        )
        self.sampling_params: list[SamplingParams | None] = []
        self.generators: dict[int, torch.Generator] = {}
        #: (layout_version, rows, metadata) of the last ``sampling_metadata`` call.
        self._sampling_cache: tuple[int, list[int], SamplingMetadata] | None = None
        self.cache_sampling_metadata = True
        #: Requests in the batch that are not plain greedy (random, or asking for log-probs).
        self._num_not_greedy = 0

    # -- membership -------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def is_dense(self) -> bool:
        """Whether rows ``[0, num_reqs)`` hold every request (no hole to condense)."""
        return len(self._req_ids) == len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request ids of rows ``[0, num_reqs)`` (valid after ``condense``)."""
        ids = self._req_ids[: self.num_reqs]
        assert None not in ids, "condense() before reading req_ids"
        return ids  # type: ignore[return-value]

    @property
    def states(self) -> list[CachedRequestState]:
        """Request states of rows ``[0, num_reqs)`` (valid after ``condense``)."""
        return self._states[: self.num_reqs]  # type: ignore[return-value]

    def add_request(self, req: CachedRequestState) -> int:
        """Place a request at the first free row; returns the row."""
        try:
            row = self._req_ids.index(None)
        except ValueError:
            row = len(self._req_ids)
            if row >= self.max_num_reqs:
                raise RuntimeError(f"input batch is full ({self.max_num_reqs} requests)") from None
            self._req_ids.append(None)
            self._states.append(None)
            self.sampling_params.append(None)
        self.layout_version += 1
        self._req_ids[row] = req.req_id
        self._states[row] = req
        self.req_id_to_index[req.req_id] = row
        n_prompt, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
        self.token_ids_cpu[row, :n_prompt] = req.prompt_token_ids
        self.token_ids_cpu[row, n_prompt : n_prompt + n_out] = req.output_token_ids
        self.num_tokens[row] = n_prompt + n_out
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens_cpu[row] = req.num_computed_tokens
        self.block_table.add_row(req.block_ids, row)
        self.sampling_params[row] = req.sampling_params
        self._num_not_greedy += not _plain_greedy(req.sampling_params)
        if req.generator is not None:
            self.generators[row] = req.generator
        return row

    def remove_request(self, req_id: str, *, sync_state: bool = True) -> int | None:
        """Free a request's row (leaving a hole until ``condense``); its state
        takes the row's output tokens and computed count (``sync_state``:
        False for a request that ended, whose state is dropped)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        state = self._states[row]
        if sync_state and state is not None:
            start = len(state.prompt_token_ids)
            state.output_token_ids[:] = self.token_ids_cpu[
                row, start : self.num_tokens[row]
            ].tolist()
            state.num_computed_tokens = int(self.num_computed_tokens_cpu[row])
        self.layout_version += 1
        params = self.sampling_params[row]
        self._num_not_greedy -= params is not None and not _plain_greedy(params)
        self._req_ids[row] = None
        self._states[row] = None
        self.sampling_params[row] = None
        self.generators.pop(row, None)
        return row

    def append_token(self, row: int, token_id: int) -> None:
        n = int(self.num_tokens[row])
        self.token_ids_cpu[row, n] = token_id
        self.num_tokens[row] = n + 1

    def append_tokens(self, rows: np.ndarray | None, token_ids: np.ndarray) -> None:
        """``append_token`` for each of ``rows`` (distinct; None: rows 0, 1,
        ... one per token) at once."""
        if rows is None:
            num_tokens = self.num_tokens[: len(token_ids)]
            self.token_ids_cpu[self._rows[: len(token_ids)], num_tokens] = token_ids
            num_tokens += 1  # (a view)
            return
        n = self.num_tokens[rows]
        self.token_ids_cpu[rows, n] = token_ids
        self.num_tokens[rows] = n + 1

    # -- row moves --------------------------------------------------------

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None
        self.layout_version += 1
        n = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        self.num_tokens[dst] = n
        self.num_prompt_tokens[dst] = self.num_prompt_tokens[src]
        self.num_computed_tokens_cpu[dst] = self.num_computed_tokens_cpu[src]
        self.block_table.move_row(src, dst)
        self._req_ids[dst], self._req_ids[src] = req_id, None
        self._states[dst], self._states[src] = self._states[src], None
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        self.req_id_to_index[req_id] = dst
        if src in self.generators:
            self.generators[dst] = self.generators.pop(src)

    def condense(self) -> None:
        """Fill holes with the last rows so rows ``[0, num_reqs)`` are dense."""
        if self.is_dense:
            return  # no request left since the last condense
        n = self.num_reqs
        holes = [row for row in range(n) if self._req_ids[row] is None]
        tail = [row for row in range(len(self._req_ids) - 1, n - 1, -1) if self._req_ids[row]]
        for hole, src in zip(holes, tail, strict=True):
            self._move_row(src, hole)
        del self._req_ids[n:]
        del self._states[n:]
        del self.sampling_params[n:]

    def swap_states(self, a: int, b: int) -> None:
        ia, ib = self._req_ids[a], self._req_ids[b]
        assert ia is not None and ib is not None
        self.layout_version += 1
        n = int(max(self.num_tokens[a], self.num_tokens[b]))
        self.token_ids_cpu[[a, b], :n] = self.token_ids_cpu[[b, a], :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu):
            arr[[a, b]] = arr[[b, a]]
        self.block_table.swap_row(a, b)
        self._req_ids[a], self._req_ids[b] = ib, ia
        self._states[a], self._states[b] = self._states[b], self._states[a]
        self.req_id_to_index[ia], self.req_id_to_index[ib] = b, a
        sp = self.sampling_params
        sp[a], sp[b] = sp[b], sp[a]
        ga, gb = self.generators.pop(a, None), self.generators.pop(b, None)
        if gb is not None:
            self.generators[a] = gb
        if ga is not None:
            self.generators[b] = ga

    def reorder_decodes_first(self, num_scheduled_tokens: dict[str, int]) -> int:
        """Move one-token requests to the front; returns how many there are.
        The first non-decode swaps with the last decode, the second with the
        one before, ... (every other row stays)."""
        ids = self.req_ids
        counts = np.fromiter(map(num_scheduled_tokens.__getitem__, ids), np.int64, len(ids))
        is_decode = counts == 1
        num_decodes = int(is_decode.sum())
        front = np.flatnonzero(~is_decode[:num_decodes])
        if len(front):
            back = np.flatnonzero(is_decode[num_decodes:])[::-1] + num_decodes
            for a, b in zip(front.tolist(), back.tolist(), strict=True):
                self.swap_states(a, b)
        return num_decodes

    # -- sampling ---------------------------------------------------------

    def sampling_metadata(self, rows: list[int]) -> SamplingMetadata:
        """Sampling parameters of the given rows, in that order; the last
        call's metadata again while the same requests sample in the same
        rows, or the one all-greedy metadata while every request is plain
        greedy (no log-probs, no logits processing; the sampler only reads
        it)."""
        if self._num_not_greedy == 0 and self.cache_sampling_metadata and rows:
            return _ALL_GREEDY
        cached = self._sampling_cache
        if cached is not None and cached[0] == self.layout_version and cached[1] == rows:
            return cached[2]
        metadata = self._build_sampling_metadata(rows)
        if self.cache_sampling_metadata:
            self._sampling_cache = (self.layout_version, list(rows), metadata)
        return metadata

    def sampling_metadata_of_positions(self, rows: list[int]) -> SamplingMetadata:
        """Sampling parameters with one entry per position of ``rows`` (a
        row may repeat: one entry per draft token of a speculative step;
        a seeded row's generator serves each of its entries, in order).
        Not cached."""
        return self._build_sampling_metadata(rows)

    def token_history(
        self,
        rows: list[int],
        seq_lens: np.ndarray,
        last_token_ids: torch.Tensor | None,
        processing: LogitsProcessing,
    ) -> TokenHistory:
        """The step's tokens of the sampling ``rows`` for ``processing``:
        ``seq_lens`` the rows' lengths once the step is computed (int64),
        ``last_token_ids`` the step's last input token of each, on the
        device (with async scheduling the host may not know it yet; it
        knows every token before it); it may be None when
        ``processing.needs_token_ids`` is False."""
        sample_rows = np.asarray(rows, dtype=np.int64)
        num_output = None
        if processing.min_tokens is not None:
            num_output = seq_lens - self.num_prompt_tokens[sample_rows]
        if not processing.needs_token_ids:
            return TokenHistory(num_output, None, None, None)
        assert last_token_ids is not None, "token ids needed: pass the last input tokens"
        batch_rows = sample_rows[processing.history_rows]
        lens = seq_lens[processing.history_rows]
        if (self.num_tokens[batch_rows] < lens - 1).any():
            raise RuntimeError("a sampling row lacks more than its last token on the host")
        width = int(lens.max())
        known = self.token_ids_cpu[batch_rows, :width].astype(np.int64)
        token_ids = to_device(known, self.device)
        lens_t = to_device(lens, self.device)
        last = last_token_ids
        if processing.history_index is not None:
            last = last.index_select(0, processing.history_index)
        token_ids.scatter_(1, (lens_t - 1).unsqueeze(1), last.unsqueeze(1).to(torch.int64))
        num_prompt = to_device(self.num_prompt_tokens[batch_rows].astype(np.int64), self.device)
        return TokenHistory(num_output, token_ids, lens_t, num_prompt)

    def _build_sampling_metadata(self, rows: list[int]) -> SamplingMetadata:
        params = [self.sampling_params[row] for row in rows]
        assert all(p is not None for p in params)
        generators = {
            i: self.generators[row] for i, row in enumerate(rows) if row in self.generators
        }
        return SamplingMetadata.from_params(params, generators, self.device)  # type: ignore[arg-type]


def _plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and params.logprobs is None and not params.processes_logits


#: What ``SamplingMetadata.from_params`` makes of any rows that are all plain greedy.
_ALL_GREEDY = SamplingMetadata(
    temperature=None,
    all_greedy=True,
    all_random=False,
    top_p=None,
    top_k=None,
    min_p=None,
    generators={},
    max_num_logprobs=None,
)
