"""Micro-batches: a large step cut in two, so that one half's tensor-parallel
communication overlaps the other half's compute (vLLM's dual-batch overlap).

:func:`maybe_create_ubatch_slices` cuts a step of ``num_tokens`` (padded)
tokens at ``num_tokens // 2``; the request that holds that token is split
between the two micro-batches (its first tokens in the first, the rest in
the second). :func:`split_attention_metadata` gives each micro-batch its own
attention metadata: the requests it touches, their query ranges rebased to
the micro-batch, and, for a split request in the first half, the sequence
length as of its last query there (the second half's keys are not stored
yet when the first half attends: causality makes them invisible anyway).

Pure numpy: the runner moves the arrays to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["UBatchSlice", "maybe_create_ubatch_slices", "split_host_metadata"]


@dataclass(frozen=True)
class UBatchSlice:
    """The requests (rows) and tokens of one micro-batch."""

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


def maybe_create_ubatch_slices(
    num_scheduled_tokens: np.ndarray,
    num_tokens_padded: int,
    *,
    uniform_decode: bool,
    decode_threshold: int = 32,
    prefill_threshold: int = 512,
) -> list[UBatchSlice] | None:
    """Two micro-batches when the step is large enough (``decode_threshold``
    tokens for a batch of decodes, ``prefill_threshold`` otherwise); None to
    run it whole. The cut is at ``num_tokens_padded // 2``; the second
    micro-batch ends at the last real token."""
    total = int(num_scheduled_tokens.sum())
    threshold = decode_threshold if uniform_decode else prefill_threshold
    split = num_tokens_padded // 2
    if total < threshold or not 0 < split < total:
        return None
    cu = np.cumsum(num_scheduled_tokens)
    # The request holding token `split`: the first whose tokens end past it.
    spanning = int(np.searchsorted(cu, split, side="right"))
    cut_between_requests = spanning > 0 and int(cu[spanning - 1]) == split
    first_reqs = spanning if cut_between_requests else spanning + 1
    second_start = spanning
    return [
        UBatchSlice(slice(0, first_reqs), slice(0, split)),
        UBatchSlice(slice(second_start, len(num_scheduled_tokens)), slice(split, total)),
    ]


@dataclass
class UBatchHostMetadata:
    """One micro-batch's host-side attention inputs."""

    query_start_loc: np.ndarray  # [reqs + 1] int32, from 0
    seq_lens: np.ndarray  # [reqs] int32
    block_rows: np.ndarray  # [reqs] int64: the step's block-table rows


def split_host_metadata(
    ubatch: UBatchSlice, query_start_loc: np.ndarray, seq_lens: np.ndarray
) -> UBatchHostMetadata:
    """Query ranges and sequence lengths of the requests in ``ubatch``,
    clipped to its tokens (a split request keeps only its part)."""
    rows = np.arange(ubatch.request_slice.start, ubatch.request_slice.stop)
    start, stop = ubatch.token_slice.start, ubatch.token_slice.stop
    q_start = np.clip(query_start_loc[rows], start, stop)
    q_end = np.clip(query_start_loc[rows + 1], start, stop)
    # Tokens of each request that come after this micro-batch's end.
    tokens_after = query_start_loc[rows + 1] - q_end
    qsl = np.concatenate([[0], np.cumsum(q_end - q_start)]).astype(np.int32)
    return UBatchHostMetadata(
        query_start_loc=qsl,
        seq_lens=(seq_lens[rows] - tokens_after).astype(np.int32),
        block_rows=rows.astype(np.int64),
    )


def num_leading_decodes(query_start_loc: np.ndarray) -> int:
    """Requests at the front with exactly one query token (decodes come first)."""
    lens = np.diff(query_start_loc)
    not_decode = np.flatnonzero(lens != 1)
    return int(not_decode[0]) if len(not_decode) else len(lens)
