"""Where a speculative step's draft tokens are and which logits verify them
(vLLM's ``SpecDecodeMetadata``): :class:`SpecDecodeMetadata`, built with the
step's inputs (:func:`build_spec_decode_metadata`) and kept in the
``ExecuteModelState`` until ``sample_tokens``.

A step with drafts computes logits at every draft position and at each
sampling request's last token: for a sampling row with ``d`` drafts, its
query's last ``d + 1`` tokens (the token before the drafts and the drafts).
The logits of draft position ``j`` (the target model's distribution for
draft ``j``) are at the token before draft ``j``; the last of the ``d + 1``
is the *bonus* position (the token after every draft, or after none).

May import numpy and torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SpecDecodeMetadata", "build_spec_decode_metadata"]


@dataclass
class SpecDecodeMetadata:
    """One speculative step's drafts, per sampling row (the step's sample
    rows, in order); indices ``*_logits_indices`` point into the step's
    logits tensor (one row per ``logits_indices`` entry)."""

    #: Every sampling row's drafts, concatenated: ``[num_draft_tokens_total]``.
    draft_token_ids: torch.Tensor
    #: Drafts of each sampling row (0 for rows without any).
    num_draft_tokens: list[int]
    #: The logits row of each draft's position, in ``draft_token_ids`` order.
    target_logits_indices: torch.Tensor
    #: The logits row of each sampling row's bonus position.
    bonus_logits_indices: torch.Tensor
    #: The step's token index of each sampling row's last token (what a
    #: sampler's token history reads as the newest token).
    last_token_indices: torch.Tensor

    @property
    def max_spec_len(self) -> int:
        return max(self.num_draft_tokens, default=0)


def build_spec_decode_metadata(
    drafts: list[list[int]], cu_num_tokens: np.ndarray, device: torch.device
) -> tuple[np.ndarray, SpecDecodeMetadata]:
    """The step's logits indices and its metadata, for sampling rows whose
    drafts are ``drafts`` (in sample row order) and whose queries end at
    ``cu_num_tokens`` (their cumulative token counts, same order). Returns
    the token indices to compute logits at (host int64)."""
    num_drafts = np.fromiter(map(len, drafts), np.int64, len(drafts))
    num_logits = num_drafts + 1
    ends = cu_num_tokens.astype(np.int64)  # one past each row's last token
    starts = ends - num_logits
    cu_logits = np.cumsum(num_logits)
    first_logit = cu_logits - num_logits
    total = int(cu_logits[-1]) if len(cu_logits) else 0
    # Token index of every logits row: each sampling row's last d + 1 tokens.
    offsets = np.arange(total) - np.repeat(first_logit, num_logits)
    logits_indices = np.repeat(starts, num_logits) + offsets
    bonus = cu_logits - 1
    # A draft's logits row: its row's first logits row + its index in the row.
    draft_rows = np.repeat(np.arange(len(drafts)), num_drafts)
    draft_offsets = np.arange(int(num_drafts.sum())) - np.repeat(
        np.cumsum(num_drafts) - num_drafts, num_drafts
    )
    target = first_logit[draft_rows] + draft_offsets
    flat = [t for row in drafts for t in row]

    def tensor(values: np.ndarray | list[int]) -> torch.Tensor:
        return to_device(np.asarray(values, dtype=np.int64), device)

    metadata = SpecDecodeMetadata(
        draft_token_ids=tensor(flat),
        num_draft_tokens=num_drafts.tolist(),
        target_logits_indices=tensor(target),
        bonus_logits_indices=tensor(bonus),
        last_token_indices=tensor(ends - 1),
    )
    return logits_indices, metadata


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the device's
    queue (pinned memory, a non-blocking copy); on the CPU, the array's memory."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
