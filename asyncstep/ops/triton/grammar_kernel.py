"""The Triton kernel that applies grammar bitmasks to logits in place: one
launch for every constrained row of a step (the torch formulation took ten
launches, each paid in host time; ``benchmarks/studies/structured/README.md``).

May import torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Logits per program.
BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    logits_stride,
    bitmask_ptr,
    num_words,
    rows_ptr,
    vocab,
    BLOCK: tl.constexpr,
):
    """Program (r, b): bitmask row ``r`` onto logits row ``rows[r]``, tokens
    ``[b * BLOCK, (b + 1) * BLOCK)``; a token whose bit is clear (or beyond
    the bitmask) gets -inf."""
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tokens // 32
    word = tl.load(
        bitmask_ptr + r * num_words + words, mask=in_vocab & (words < num_words), other=0
    )
    banned = ((word >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=in_vocab & banned)


def apply_bitmask_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """``logits[rows[i]]`` masked by ``bitmask[i]`` (int32 words, bit ``t % 32``
    of word ``t // 32`` allows token ``t``), in place; ``rows`` int64, on
    ``logits``' device, like ``bitmask``."""
    if logits.stride(-1) != 1 or not bitmask.is_contiguous():
        raise ValueError(
            "apply_bitmask_rows needs unit-stride logits rows and a contiguous bitmask"
        )
    num_rows, vocab = rows.shape[0], logits.shape[-1]
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    _apply_bitmask_kernel[grid](
        logits, logits.stride(0), bitmask, bitmask.shape[-1], rows, vocab, BLOCK=BLOCK
    )
