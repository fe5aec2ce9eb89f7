"""A step's sampled tokens on their way from the device to the host (vLLM's
``AsyncModelRunnerOutput``).

``sample_tokens`` enqueues the sampler, leaves the sampled ids on the device
(the next step's input ids are scattered from them) and starts a
non-blocking copy of them (and of the log-probs) into pinned host memory on
a copy stream (:func:`~asyncstep.runner.host_copy.copy_to_host`), with its
own event (a step's prompt log-probs have a copy of their own:
:mod:`asyncstep.runner.prompt_logprobs`).
:class:`AsyncModelRunnerOutput` holds that copy: ``await wait()`` (or
``synchronize()``) until it landed, then
``get_output()`` builds the :class:`ModelRunnerOutput` from host memory only,
off the runner's thread: it touches no runner state.

On the CPU the "copy" is the sampled tensor itself and its event is complete
at once.

May import torch, :mod:`asyncstep.device` and :mod:`asyncstep.datatypes` (and, for
types only, :mod:`asyncstep.runner.prompt_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncstep.datatypes import Logprobs, ModelRunnerOutput
from asyncstep.device.stream import StreamEvent

if TYPE_CHECKING:
    from asyncstep.runner.prompt_logprobs import HostPromptLogprobs

__all__ = ["AsyncModelRunnerOutput"]


@dataclass
class _HostLogprobs:
    token_ids: torch.Tensor  # [n, k + 1]
    logprobs: torch.Tensor
    ranks: torch.Tensor  # [n]
    #: Log-probs each sample row asked for (None: that row did not).
    num_logprobs: list[int | None]
    #: A speculative step: each sample row's positions (drafts + 1), whose
    #: entries follow one another (its tokens take the first ones); None:
    #: one entry per sample row.
    positions: list[int] | None = None


class AsyncModelRunnerOutput:
    """One step's output whose tokens are still being copied to the host."""

    def __init__(
        self,
        req_ids: list[str],
        sample_rows: list[int],
        sampled_host: torch.Tensor,
        copy_event: StreamEvent,
        logprobs: _HostLogprobs | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.sample_rows = sample_rows
        self._sampled_host = sampled_host
        self._logprobs = logprobs
        self.copy_event = copy_event
        #: The step's prompt log-probs (their own copy), when a request asked.
        self.prompt_logprobs: HostPromptLogprobs | None = None
        #: ``draft_model`` speculation: the draft tokens per request id.
        self.draft_token_ids: dict[str, list[int]] | None = None

    async def wait(self) -> None:
        """Until the copy landed (shielded: the copy cannot be cancelled)."""
        await self.copy_event.wait()
        if self.prompt_logprobs is not None:
            await self.prompt_logprobs.copy_event.wait()

    def synchronize(self) -> None:
        self.copy_event.synchronize()

    @property
    def multi_token(self) -> bool:
        """Whether a sample row may have several tokens (a speculative step:
        ``sampled_token_lists``)."""
        return self._sampled_host.dim() == 2

    def sampled_token_lists(self) -> list[list[int]]:
        """The tokens of each sample row (blocks until the copy landed): a
        speculative step's rows are padded with -1, dropped here."""
        self.copy_event.synchronize()
        if not self.multi_token:
            return [[token] for token in self._sampled_host.tolist()]
        return [[t for t in row if t >= 0] for row in self._sampled_host.tolist()]

    def sampled_token_ids(self) -> list[int]:
        """The token of each sample row (blocks until the copy landed); one
        token per row only (not ``multi_token``)."""
        assert not self.multi_token, "a speculative step's rows: sampled_token_lists()"
        self.copy_event.synchronize()
        tokens: list[int] = self._sampled_host.tolist()  # int64: Python ints already
        return tokens

    def sampled_token_array(self) -> np.ndarray:
        """:meth:`sampled_token_ids` as an int64 array (a view of the host copy)."""
        self.copy_event.synchronize()
        return self._sampled_host.numpy()

    def get_output(self) -> ModelRunnerOutput:
        """The :class:`ModelRunnerOutput` (blocks until the copy landed)."""
        req_ids, rows = self.req_ids, self.sample_rows
        sampled: list[list[int]]
        if self.multi_token:
            sampled = [[] for _ in req_ids]
            for row, row_tokens in zip(rows, self.sampled_token_lists(), strict=True):
                sampled[row] = row_tokens
            return self._output(sampled)
        tokens = self.sampled_token_ids()
        if len(rows) == len(req_ids):  # every row sampled: rows are 0, 1, ... in order
            sampled = [[token] for token in tokens]
        else:
            sampled = [[] for _ in req_ids]
            for row, token in zip(rows, tokens, strict=True):
                sampled[row] = [token]
        return self._output(sampled)

    def _output(self, sampled: list[list[int]]) -> ModelRunnerOutput:
        req_ids = self.req_ids
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=dict(zip(req_ids, range(len(req_ids)), strict=True)),
            sampled_token_ids=sampled,
            logprobs=self._logprobs_lists(),
            prompt_logprobs=(
                self.prompt_logprobs.to_lists() if self.prompt_logprobs is not None else None
            ),
            draft_token_ids=self.draft_token_ids,
        )

    def _logprobs_lists(self) -> list[list[Logprobs]] | None:
        lp = self._logprobs
        if lp is None:
            return None
        out: list[list[Logprobs]] = [[] for _ in self.req_ids]
        if lp.positions is not None:
            return self._spec_logprobs_lists(lp, out)
        rows = zip(
            self.sample_rows,
            lp.token_ids.tolist(),
            lp.logprobs.tolist(),
            lp.ranks.tolist(),
            lp.num_logprobs,
            strict=True,
        )
        for row, ids, values, rank, n in rows:
            if n is not None:
                out[row] = [Logprobs(ids[: n + 1], values[: n + 1], rank)]
        return out

    def _spec_logprobs_lists(
        self, lp: _HostLogprobs, out: list[list[Logprobs]]
    ) -> list[list[Logprobs]]:
        """:meth:`_logprobs_lists` of a speculative step: a sample row's
        first ``len(tokens)`` entries of its positions."""
        assert lp.positions is not None
        ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
        start = 0
        tokens = self.sampled_token_lists()
        for i, (row, n) in enumerate(zip(self.sample_rows, lp.num_logprobs, strict=True)):
            if n is not None:
                out[row] = [
                    Logprobs(ids[k][: n + 1], values[k][: n + 1], ranks[k])
                    for k in range(start, start + len(tokens[i]))
                ]
            start += lp.positions[i]
        return out


def host_logprobs(
    tensors: list[torch.Tensor],
    num_logprobs: list[int | None],
    positions: list[int] | None = None,
) -> _HostLogprobs:
    """``positions``: a speculative step's positions per sample row (see
    :class:`_HostLogprobs`)."""
    token_ids, logprobs, ranks = tensors
    return _HostLogprobs(token_ids, logprobs, ranks, num_logprobs, positions)
