"""The rejection sampler: a speculative step's draft tokens checked against
the target model's logits (vLLM v1's ``RejectionSampler``).

For each sampling row with ``d`` drafts, draft ``j`` is accepted while every
draft before it was; the row's output is its accepted drafts, then one
token of the target model: at the first rejected position the *recovered*
token, or, when all ``d`` were accepted, the *bonus* token sampled at the
position after the drafts (which the ordinary sampler draws). So a row
yields ``1 + accepted`` tokens.

* Greedy rows accept draft ``j`` when it is the argmax of the target's
  logits there; the recovered token is that argmax. The output is exactly
  the greedy output without speculation.
* Random rows follow speculative sampling (Leviathan et al.; vLLM's rule)
  with a one-hot draft distribution ``q`` (the n-gram proposer's): draft
  ``x`` is accepted with probability ``min(1, p(x) / q(x)) = p(x)``, ``p``
  the target's distribution after temperature, top-k, top-p and min-p; on
  rejection the token is drawn from ``max(p - q, 0)`` renormalized (``p``
  without ``x``). Each output token is then distributed as ``p``. A seeded
  row draws from its own generator.

Everything stays on the logits' device; no host sync. May import torch,
numpy, ``asyncstep.datatypes`` and the runner's ``sampler`` and
``spec_decode_metadata`` modules.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncstep.datatypes import GREEDY_EPSILON
from asyncstep.runner.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_temperature,
    apply_top_k_top_p,
    argmax_rows,
    random_sample,
)
from asyncstep.runner.spec_decode_metadata import to_device

__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionSampler", "rejection_sample", "target_probs"]

#: Fills a row's output past its tokens.
PLACEHOLDER_TOKEN_ID = -1


def target_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each row of float32 ``logits`` samples from (as the
    :class:`~asyncstep.runner.sampler.Sampler` does: temperature, top-k,
    top-p, min-p, softmax); greedy rows' values are unused."""
    assert metadata.temperature is not None, "probabilities of random rows only"
    logits = apply_temperature(logits, metadata.temperature)
    logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
    if metadata.min_p is not None:
        logits = apply_min_p(logits, metadata.min_p)
    return logits.softmax(dim=-1)


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    accepted: torch.Tensor,
    recovered_token_ids: torch.Tensor,
    bonus_token_ids: torch.Tensor,
) -> torch.Tensor:
    """Each row's output tokens, ``[num_rows, max(num_draft_tokens) + 1]``
    int64, padded with :data:`PLACEHOLDER_TOKEN_ID`: the accepted prefix of
    its drafts, then its recovered token at the first rejection, or its
    bonus token after all ``d`` drafts. ``draft_token_ids``, ``accepted``
    (bool) and ``recovered_token_ids`` hold one entry per draft, rows'
    drafts concatenated; ``bonus_token_ids`` one per row."""
    device = bonus_token_ids.device
    num_rows = len(num_draft_tokens)
    width = max(num_draft_tokens, default=0)
    counts_np = np.asarray(num_draft_tokens, dtype=np.int64)
    starts = np.cumsum(counts_np) - counts_np
    # Each draft's row and position in it, and each row's count: one copy.
    layout = np.concatenate(
        [
            np.repeat(np.arange(num_rows), counts_np),
            np.arange(int(counts_np.sum())) - np.repeat(starts, counts_np),
            counts_np,
        ]
    )
    on_device = to_device(layout, device)
    num_total = int(counts_np.sum())
    row_of, pos_of = on_device[:num_total], on_device[num_total : 2 * num_total]
    counts = on_device[2 * num_total :]
    shape = (num_rows, width + 1)
    accepted_mat = torch.zeros(shape, dtype=torch.bool, device=device)
    accepted_mat[row_of, pos_of] = accepted
    drafts_mat = torch.full(shape, PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    drafts_mat[row_of, pos_of] = draft_token_ids
    recovered_mat = torch.zeros(shape, dtype=torch.int64, device=device)
    recovered_mat[row_of, pos_of] = recovered_token_ids
    # Accepted prefix length: the column of the first rejection (padding rejects).
    num_accepted = accepted_mat.to(torch.int64).cumprod(dim=1).sum(dim=1)
    columns = torch.arange(width + 1, device=device)
    output = torch.where(
        columns < num_accepted.unsqueeze(1),
        drafts_mat,
        torch.full_like(drafts_mat, PLACEHOLDER_TOKEN_ID),
    )
    all_accepted = num_accepted == counts
    recovered = recovered_mat.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    last = torch.where(all_accepted, bonus_token_ids, recovered)
    output.scatter_(1, num_accepted.unsqueeze(1), last.unsqueeze(1))
    return output


def _greedy_on_host(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    argmax: torch.Tensor,
    bonus_token_ids: torch.Tensor,
) -> torch.Tensor:
    """:func:`rejection_sample` of all-greedy rows whose tensors are host
    memory (the CPU): a few list operations cost less than the tensor ops."""
    drafts, targets, bonus = draft_token_ids.tolist(), argmax.tolist(), bonus_token_ids.tolist()
    width = max(num_draft_tokens) + 1
    rows: list[list[int]] = []
    start = 0
    for row, count in enumerate(num_draft_tokens):
        out: list[int] = []
        for j in range(start, start + count):
            out.append(targets[j])  # the draft when accepted, else the recovered token
            if targets[j] != drafts[j]:
                break
        else:
            out.append(bonus[row])
        rows.append(out + [PLACEHOLDER_TOKEN_ID] * (width - len(out)))
        start += count
    return torch.tensor(rows, dtype=torch.int64)


class RejectionSampler:
    """Verifies a step's drafts: :meth:`__call__` (see the module doc)."""

    def __call__(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: list[int],
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> torch.Tensor:
        """Output tokens per row (see :func:`rejection_sample`).
        ``target_logits``: one row per draft (the target's logits at its
        position); ``metadata``: the sampling settings of each draft's
        position (its row's, repeated); ``bonus_token_ids``: each row's token
        sampled at its bonus position."""
        if draft_token_ids.numel() == 0:
            return bonus_token_ids.unsqueeze(1)
        logits = target_logits.float()
        argmax = argmax_rows(logits)
        if metadata.all_greedy and logits.device.type == "cpu":
            return _greedy_on_host(draft_token_ids, num_draft_tokens, argmax, bonus_token_ids)
        if metadata.all_greedy:
            accepted = argmax == draft_token_ids
            recovered = argmax
        else:
            accepted, recovered = self._sample_random(logits, draft_token_ids, metadata)
            if not metadata.all_random:
                assert metadata.temperature is not None
                greedy = metadata.temperature < GREEDY_EPSILON
                accepted = torch.where(greedy, argmax == draft_token_ids, accepted)
                recovered = torch.where(greedy, argmax, recovered)
        return rejection_sample(
            draft_token_ids, num_draft_tokens, accepted, recovered, bonus_token_ids
        )

    @staticmethod
    def _sample_random(
        logits: torch.Tensor, draft_token_ids: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Acceptance (``u < p(draft)``) and the recovered token (from ``p``
        without the draft, renormalized) of every draft position."""
        probs = target_probs(logits, metadata)
        draft_probs = probs.gather(1, draft_token_ids.unsqueeze(1)).squeeze(1)
        uniform = torch.rand(draft_probs.shape, device=probs.device)
        for i, generator in metadata.generators.items():
            uniform[i] = torch.rand((), device=probs.device, generator=generator)
        accepted = uniform < draft_probs
        residual = probs.scatter(1, draft_token_ids.unsqueeze(1), 0.0)
        # p(draft) == 1 leaves nothing (and never rejects): any token will do.
        residual[:, 0] += (residual.sum(dim=1) <= 0).to(residual.dtype)
        recovered = random_sample(residual, metadata.generators)
        return accepted, recovered
