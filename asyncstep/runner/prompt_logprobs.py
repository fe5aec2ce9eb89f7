"""Prompt log-probs (vLLM's ``SamplingParams.prompt_logprobs``), off the hot path.

For a request that asks for ``k``, every prompt position ``p >= 1`` gets the
log-prob of the prompt's token ``p`` given the tokens before it, and the
top-k of that position (a :class:`~asyncstep.datatypes.Logprobs`: the prompt
token first, its rank), from the raw logits: log-softmax in float32, as for
the sampled tokens' ``logprobs``. Position ``p`` is predicted by the hidden
state of token ``p - 1``, so a step that computes positions ``[s, s + n)``
of a prompt of ``P`` tokens yields positions ``s + 1 .. min(s + n, P - 1)``
(the last prompt token's hidden state samples): a chunked prefill yields
its positions chunk by chunk.

:class:`PromptLogprobsTracker` keeps, per request of this rank that asks,
the next position it owes; positions recomputed (after a preemption) are not
returned twice, and a request is forgotten once it owes nothing. A step
without such a request costs the runner one test of an empty dict. A step
with one takes the extra logits from the step's hidden states (or, from a
CUDA graph that ends with the LM head, its logits), outside any graph, in
slices of positions whose float32 logits hold at most ``MAX_LOGITS_BYTES``
(a slice's logits, their log-softmax and the rank comparison live at once;
only the top-k and the prompt tokens' values are kept), and copies the
results to the host on the copy stream; :class:`HostPromptLogprobs` turns
them into the per-request lists of the ``ModelRunnerOutput``.

May import torch, numpy, :mod:`asyncstep.datatypes`, :mod:`asyncstep.device`
and the runner's sampler, async output and input batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.datatypes import Logprobs, SchedulerOutput
from asyncstep.device.stream import StreamEvent
from asyncstep.runner.host_copy import copy_to_host
from asyncstep.runner.input_batch import InputBatch
from asyncstep.runner.logits_processing import list_to_device
from asyncstep.runner.sampler import compute_logprobs, gather_logprobs

__all__ = ["MAX_LOGITS_BYTES", "HostPromptLogprobs", "PromptLogprobsTracker", "rows_at_once"]

#: Most bytes of one slice's float32 logits (``[rows, vocab]``): a step's
#: prompt positions are computed that many rows at a time.
MAX_LOGITS_BYTES = 16 << 20


def rows_at_once(vocab_size: int) -> int:
    """Positions whose float32 logits fit :data:`MAX_LOGITS_BYTES` (at least one)."""
    return max(1, MAX_LOGITS_BYTES // (4 * vocab_size))


@dataclass
class _Owed:
    """A request's prompt log-probs still to return."""

    num_logprobs: int
    prompt_token_ids: list[int]
    #: The first prompt position not returned yet.
    next_position: int = 1


@dataclass
class _Piece:
    """One request's positions in a step's results: ``count`` rows, ``k`` top."""

    req_id: str
    count: int
    num_logprobs: int


@dataclass
class HostPromptLogprobs:
    """A step's prompt log-probs on their way to the host: the rows of every
    request, in order (``[rows, max k + 1]``; rank per row)."""

    pieces: list[_Piece]
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    copy_event: StreamEvent

    def to_lists(self) -> dict[str, list[Logprobs]]:
        """Request id -> one :class:`Logprobs` per position (blocks until the copy landed)."""
        self.copy_event.synchronize()
        ids, values, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        out: dict[str, list[Logprobs]] = {}
        start = 0
        for piece in self.pieces:
            width, end = piece.num_logprobs + 1, start + piece.count
            out[piece.req_id] = [
                Logprobs(ids[i][:width], values[i][:width], ranks[i]) for i in range(start, end)
            ]
            start = end
        return out


class PromptLogprobsTracker:
    """The prompt log-probs a rank owes (see the module doc); inactive on a
    pipeline stage that does not sample."""

    def __init__(self, vocab_size: int, *, enabled: bool = True) -> None:
        """``vocab_size``: the logits' width (it sizes the slices)."""
        self.enabled = enabled
        self.rows_at_once = rows_at_once(vocab_size)
        #: Request id -> what it is still owed; empty when no request asks.
        self.owed: dict[str, _Owed] = {}

    def update(self, so: SchedulerOutput) -> None:
        """Forget finished requests; take the new ones that ask."""
        if self.owed and so.finished_req_ids:
            for req_id in so.finished_req_ids:
                self.owed.pop(req_id, None)
        if not self.enabled:
            return
        for new in so.scheduled_new_reqs:
            k = new.sampling_params.prompt_logprobs
            if k is not None and len(new.prompt_token_ids) > 1:
                self.owed[new.req_id] = _Owed(k, list(new.prompt_token_ids))

    def compute(
        self,
        so: SchedulerOutput,
        batch: InputBatch,
        out: torch.Tensor,
        to_logits: Callable[[torch.Tensor], torch.Tensor] | None,
        copy_stream: torch.cuda.Stream | None,
    ) -> HostPromptLogprobs | None:
        """The prompt log-probs of the positions the step computes, enqueued
        and being copied to the host; None when the step computes none.

        ``out``: the step's hidden states (``to_logits`` makes logits of
        them), or its logits (``to_logits`` None), one row per input token;
        ``batch``: the step's persistent batch (computed counts as before
        the step)."""
        scheduled = so.num_scheduled_tokens
        rows_of = batch.req_id_to_index
        owed = [(r, o) for r, o in self.owed.items() if r in scheduled]
        if not owed:
            return None
        counts = np.fromiter(map(scheduled.__getitem__, batch.req_ids), np.int64, batch.num_reqs)
        query_start = np.cumsum(counts) - counts
        token_index: list[int] = []
        targets: list[int] = []
        pieces: list[_Piece] = []
        for req_id, o in owed:
            row = rows_of[req_id]
            computed = int(batch.num_computed_tokens_cpu[row])
            first = max(computed + 1, o.next_position)
            last = min(computed + scheduled[req_id], len(o.prompt_token_ids) - 1)
            if last >= o.next_position:
                o.next_position = last + 1
            if o.next_position >= len(o.prompt_token_ids):
                del self.owed[req_id]  # owes nothing more
            if last < first:
                continue
            offset = int(query_start[row]) + first - 1 - computed
            token_index.extend(range(offset, offset + last - first + 1))
            targets.extend(o.prompt_token_ids[first : last + 1])
            pieces.append(_Piece(req_id, last - first + 1, o.num_logprobs))
        if not pieces:
            return None
        k = max(p.num_logprobs for p in pieces)
        n = self.rows_at_once
        slices = [
            _gather(out, token_index[i : i + n], targets[i : i + n], k, to_logits)
            for i in range(0, len(token_index), n)
        ]
        tensors = [torch.cat(parts) for parts in zip(*slices, strict=True)]
        (token_ids, logprobs, ranks), event = copy_to_host(tensors, copy_stream)
        return HostPromptLogprobs(pieces, token_ids, logprobs, ranks, event)


def _gather(
    out: torch.Tensor,
    token_index: list[int],
    targets: list[int],
    k: int,
    to_logits: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The log-probs of ``targets`` (and the top ``k``) at the rows ``token_index`` of ``out``."""
    rows = out.index_select(0, list_to_device(token_index, torch.int64, out.device))
    logits = rows if to_logits is None else to_logits(rows)
    target_ids = list_to_device(targets, torch.int64, out.device)
    lp = gather_logprobs(compute_logprobs(logits), k, target_ids)
    return lp.logprob_token_ids, lp.logprobs, lp.selected_token_ranks
