"""The grammar bitmask applied to a step's logits (vLLM's
``apply_grammar_bitmask``): tokens a request's grammar forbids get ``-inf``
before any other logits processing, on the logits' device.

May import torch, numpy, ``asyncstep.datatypes``, ``asyncstep.runner.staging`` and
``asyncstep.ops`` (its Triton kernel).
"""

from __future__ import annotations

import numpy as np
import torch

from asyncstep.datatypes import GrammarOutput
from asyncstep.runner.staging import StagingBuffers


class GrammarBitmask:
    """Applies grammar bitmasks to a device's logits (vLLM's
    ``apply_grammar_bitmask``). On CUDA the rows travel through pinned
    staging buffers, so the copy neither waits for the stream (a copy from
    pageable memory waits for the forward still running) nor blocks the
    host, and one Triton kernel masks them (:mod:`asyncstep.ops.triton.grammar_kernel`);
    elsewhere torch ops do."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.staging = StagingBuffers(device)
        self._bits = torch.arange(32, dtype=torch.int32, device=device)

    def apply(
        self, logits: torch.Tensor, grammar_output: GrammarOutput, logits_row: dict[str, int]
    ) -> None:
        """Mask ``logits`` (``[rows, vocab]``) in place: for each request of
        ``grammar_output`` that has a row here (``logits_row``: request id ->
        row), every token whose bit is clear gets ``-inf``. A vocabulary
        wider than the bitmask (padded logits) has its extra tokens masked too."""
        req_ids = grammar_output.structured_output_request_ids
        pairs = [(logits_row[r], i) for i, r in enumerate(req_ids) if r in logits_row]
        self.apply_rows(logits, grammar_output, pairs)

    def apply_rows(
        self, logits: torch.Tensor, grammar_output: GrammarOutput, pairs: list[tuple[int, int]]
    ) -> None:
        """:meth:`apply` with the rows given: (logits row, bitmask row) pairs
        (a speculative step's request has a bitmask row per draft position)."""
        if not pairs:
            return
        packed = np.frombuffer(grammar_output.grammar_bitmask, dtype="<i4")
        words = packed.reshape(len(grammar_output.structured_output_request_ids), -1)
        rows, mask_rows = zip(*pairs, strict=True)
        staging = self.staging
        staging.begin_step()  # the previous step's rows were read
        bitmask = staging.to_device("grammar_bitmask", words[list(mask_rows)])
        index = staging.to_device("grammar_rows", np.array(rows, dtype=np.int64))
        staging.end_step()
        if self.device.type == "cuda":
            from asyncstep.ops.triton.grammar_kernel import apply_bitmask_rows

            apply_bitmask_rows(logits, bitmask, index)
            return
        allowed = self._unpack(bitmask, logits.shape[-1])
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))

    def _unpack(self, bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
        """``[n, words]`` int32 -> ``[n, vocab]`` bool (bit ``t % 32`` of word ``t // 32``)."""
        allowed = ((bitmask.unsqueeze(-1) >> self._bits) & 1).bool().flatten(1)
        width = allowed.shape[-1]
        if width >= vocab:
            return allowed[:, :vocab]
        return torch.nn.functional.pad(allowed, (0, vocab - width), value=False)
