"""The argmax of a few long rows (a greedy step's logits) in two Triton
launches: each program finds the maximum of one chunk of a row and its
first index there, then one program a row finds the first chunk holding
the row's maximum. The index is ``argmax``'s, the lowest on ties (inside a
chunk and across chunks), for finite and infinite values (NaN: undefined).

torch's ``argmax`` reduces a row on one block, so one SM reads a whole
vocabulary for a one-row step; the same two stages in torch ops cost
several launches of host time each. Shapes only decide the grid (no host
sync). On the CPU the kernels run under the Triton interpreter
(``TRITON_INTERPRET=1``), which the tests use.

May import torch and triton only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ARGMAX_CHUNK", "two_stage_argmax"]

#: Logits a program of the first stage reads.
ARGMAX_CHUNK = 1024


@triton.jit
def _chunk_max_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    values_ptr,
    index_ptr,
    vocab,
    stride_row,
    CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Chunk ``c`` of row ``r``: its maximum (float32) and that maximum's
    first column in the row; columns past the vocabulary read -inf."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab, other=float("-inf")
    ).to(tl.float32)
    best = tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(values_ptr + row * CHUNKS + chunk, tl.max(x, axis=0))
    tl.store(index_ptr + row * CHUNKS + chunk, chunk * CHUNK + best)


@triton.jit
def _first_best_chunk_kernel(  # type: ignore[no-untyped-def]
    values_ptr, index_ptr, out_ptr, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr
):
    """Row ``r``'s argmax: the first chunk's index among those holding the
    largest chunk maximum."""
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_PAD)
    values = tl.load(values_ptr + row * CHUNKS + chunks, mask=chunks < CHUNKS, other=float("-inf"))
    best = tl.argmax(values, axis=0, tie_break_left=True)
    tl.store(out_ptr + row, tl.load(index_ptr + row * CHUNKS + best).to(tl.int64))


def two_stage_argmax(logits: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 ``[rows]``) of a 2-D float tensor
    with unit stride along its rows; ``chunk``: a power of two."""
    if logits.dim() != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(
            f"two_stage_argmax takes a 2-D float tensor with contiguous rows, got "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16, got {chunk}")
    rows, vocab = logits.shape
    if rows == 0 or vocab == 0:
        return logits.argmax(dim=-1)  # torch's error for an empty row, or no rows
    chunks = triton.cdiv(vocab, chunk)
    values = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    index = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_max_kernel[(rows, chunks)](
        logits, values, index, vocab, logits.stride(0), CHUNKS=chunks, CHUNK=chunk, num_warps=4
    )
    _first_best_chunk_kernel[(rows,)](
        values, index, out, CHUNKS=chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), num_warps=4
    )
    return out
