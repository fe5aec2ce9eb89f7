"""Greedy sampling inside the FULL decode graph (issue 43).

A uniform one-token decode graph of the last stage ends with the logits
(:class:`~asyncstep.runner.cudagraph_runner.CudaGraphRunner`); with
:attr:`~asyncstep.config.CompilationConfig.greedy_in_graph` it also ends
with their argmax, written into one persistent buffer of token ids
(:class:`GreedyGraphIds`, row ``i`` request ``i``'s; padding rows garbage).
A step whose sampling rows are all greedy, with no log-probs, logits
processing (penalties, bias, min_tokens, bad words), grammar bitmask or
draft tokens (:func:`takes_graph_ids`) then samples nothing of its own: its
token ids are the buffer's, which the next step's input ids read (the
sampled ids' scatter), so the step launches the graph and the host copy.
Every other step samples as before, from the same graph's logits.

The ids are :func:`~asyncstep.runner.sampler.argmax_rows` of the same
logits the sampler would take its argmax of: the same tokens, bit for bit,
ties to the lowest id, for logits without NaN (the graph's padded rows may
pick :func:`~asyncstep.runner.sampler.chunked_argmax` where the sampler's
unpadded ones pick ``argmax``, and the two differ only on NaN). Each
row's argmax depends on its row only, so the padding rows change nothing.

The buffer is rewritten by every replay of a greedy graph: the step's host
copy of its ids goes on the compute stream
(:func:`~asyncstep.runner.host_copy.copy_to_host_in_order`), so the next
replay, enqueued after it, never overwrites them before they are read (and
the step switches no stream); on the CPU the ids are cloned (there the
"copy" is the tensor itself).

May import torch and :mod:`asyncstep.runner.sampler`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncstep.runner.sampler import SamplingMetadata, argmax_rows

__all__ = ["GreedyGraphIds", "takes_graph_ids"]


class GreedyGraphIds:
    """The persistent token-id buffer the greedy graphs write."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        self.ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)

    def wrap(
        self, logits_fn: Callable[[], torch.Tensor], num_tokens: int
    ) -> Callable[[], torch.Tensor]:
        """``logits_fn`` (a uniform decode graph's forward to the logits),
        then their argmax per row into ``ids[:num_tokens]``; returns the
        logits."""
        ids = self.ids[:num_tokens]

        def forward() -> torch.Tensor:
            logits = logits_fn()
            ids.copy_(argmax_rows(logits))
            return logits

        return forward


def takes_graph_ids(metadata: SamplingMetadata) -> bool:
    """Whether a step sampling with ``metadata`` takes the graph's argmax
    (every row greedy, no log-probs, no logits processing); the caller
    checks the rest (no grammar bitmask, no draft tokens)."""
    return metadata.plain_greedy
