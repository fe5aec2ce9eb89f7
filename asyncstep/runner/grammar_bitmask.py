"""The grammar bitmask applied to a step's logits (vLLM's
``apply_grammar_bitmask``): tokens a request's grammar forbids get ``-inf``
before any other logits processing, on the logits' device.

May import torch, numpy and ``asyncstep.datatypes``.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncstep.datatypes import GrammarOutput

_BITS: dict[torch.device, torch.Tensor] = {}


def apply_grammar_bitmask(
    logits: torch.Tensor, grammar_output: GrammarOutput, logits_row: dict[str, int]
) -> None:
    """Mask ``logits`` (``[rows, vocab]``) in place: for each request of
    ``grammar_output`` that has a row here (``logits_row``: request id ->
    row), every token whose bit is clear gets ``-inf``. A vocabulary wider
    than the bitmask (padded logits) has its extra tokens masked too."""
    req_ids = grammar_output.structured_output_request_ids
    pairs = [(logits_row[r], i) for i, r in enumerate(req_ids) if r in logits_row]
    if not pairs:
        return
    words = np.frombuffer(grammar_output.grammar_bitmask, dtype="<i4").reshape(len(req_ids), -1)
    rows, mask_rows = zip(*pairs, strict=True)
    device = logits.device
    bitmask = torch.from_numpy(words[list(mask_rows)]).to(device, non_blocking=True)
    allowed = _unpack(bitmask, logits.shape[-1])
    index = torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, words]`` int32 -> ``[n, vocab]`` bool (bit ``t % 32`` of word ``t // 32``)."""
    bits = _BITS.get(bitmask.device)
    if bits is None:
        bits = _BITS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)
    width = allowed.shape[-1]
    if width >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - width), value=False)
