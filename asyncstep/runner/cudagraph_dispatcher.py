"""CUDA-graph dispatch by batch shape (vLLM's ``CudagraphDispatcher``).

A step's batch is described by a :class:`BatchDescriptor` (token count,
request count, uniform decode or not). At start-up the dispatcher lists the
descriptors to capture, from the configured :class:`CUDAGraphMode` and the
capture sizes; each step it pads the batch up to the next capture size and
picks how to run it, in this order: a FULL graph of exactly this uniform
decode shape, a FULL graph of any batch of that many tokens ("relaxed"), a
PIECEWISE graph (attention eager, between graphs), else NONE (eager, unpadded).

Uniform decode batches are those whose requests each have the same number
of query tokens ``q``: one (plain decode), or, with speculative decoding,
``uniform_decode_query_len = 1 + k`` (the request's newest token and ``k``
draft tokens: a verify step where every request got all ``k`` drafts). Their
FULL graphs are keyed ``(q * s, s, uniform_decode=True)`` for each capture
size ``s`` (a request count here); a batch of ``r`` such requests is padded
to the smallest ``s >= r``. As vLLM does, a verify step where some request
got fewer than ``k`` drafts (the n-gram proposer found fewer, or the request
is near its ``max_tokens``) is not uniform: it takes the relaxed FULL graph,
else PIECEWISE, like any mixed batch; a step where no request got drafts is
a plain (``q = 1``) uniform decode.

Padding conventions (the runner applies them): padding tokens have id 0,
position 0 and slot -1 (nothing stored); padding requests have seq_len 0 and
an empty query range, so ``query_start_loc`` stays non-decreasing.

:func:`resolve_cudagraph_mode` turns the configured mode into the one the
device and the attention backend allow: NONE without CUDA, no FULL graph
over the torch reference's attention (it plans decodes on the host).

Pure Python: imports nothing from torch.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from asyncstep.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchDescriptor",
    "CUDAGraphMode",
    "CudagraphDispatcher",
    "default_capture_sizes",
    "resolve_cudagraph_mode",
]

log = structlog.get_logger(__name__)


class CUDAGraphMode(enum.Enum):
    """How a batch runs: the three runtime modes, and the two configured
    combinations (decode batches one way, mixed batches another)."""

    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_DECODE_ONLY = (2, 0)
    FULL_AND_PIECEWISE = (2, 1)

    @classmethod
    def parse(cls, name: str) -> CUDAGraphMode:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ConfigError(
                f"cudagraph_mode must be one of {[m.name for m in cls]}, got {name!r}"
            ) from None

    def decode_mode(self) -> CUDAGraphMode:
        """The runtime mode for uniform decode batches."""
        value = self.value[0] if isinstance(self.value, tuple) else self.value
        return CUDAGraphMode(value)

    def mixed_mode(self) -> CUDAGraphMode:
        """The runtime mode for every other batch."""
        value = self.value[1] if isinstance(self.value, tuple) else self.value
        return CUDAGraphMode(value)

    def has_full_cudagraphs(self) -> bool:
        return CUDAGraphMode.FULL in (self.decode_mode(), self.mixed_mode())

    def separate_decode_routine(self) -> bool:
        """Decode batches get their own (FULL) graphs, apart from mixed ones."""
        return isinstance(self.value, tuple)


@dataclass(frozen=True)
class BatchDescriptor:
    """The shape a graph was captured for (and a batch is padded to).

    ``num_reqs`` is the captured request count: ``num_tokens / q`` for a
    uniform decode graph of ``q`` query tokens per request; for a relaxed
    (mixed) FULL graph the most requests that many tokens can hold; None for
    PIECEWISE graphs (attention, the only part that depends on requests, runs
    outside them)."""

    num_tokens: int
    num_reqs: int | None = None
    uniform_decode: bool = False


def default_capture_sizes(max_size: int, max_decode_size: int | None = None) -> list[int]:
    """vLLM's sizes: 1, 2, 4, then multiples of 8 up to 256, then multiples
    of 16, up to ``max_decode_size`` (default: ``max_size``); then multiples
    of :data:`PREFILL_SIZE_STEP` up to ``max_size`` (ascending). The large
    sizes serve chunked prefills (PIECEWISE): an eager step launches its
    kernels one by one, slower than the device runs them."""
    decode_max = max_size if max_decode_size is None else min(max_decode_size, max_size)
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, decode_max + 1, 16)]
    sizes = [s for s in sizes if s <= decode_max]
    first = (decode_max // PREFILL_SIZE_STEP + 1) * PREFILL_SIZE_STEP
    return sizes + list(range(first, max_size + 1, PREFILL_SIZE_STEP))


#: Step between the large (prefill) capture sizes.
PREFILL_SIZE_STEP = 256
#: Largest default capture size (a step of more tokens runs eagerly).
MAX_DEFAULT_CAPTURE_SIZE = 4096


class CudagraphDispatcher:
    """Chooses the runtime mode and padded shape of each batch.

    ``capture_sizes``: token counts to capture (None: the default list, its
    fine steps up to ``min(2 * max_num_seqs, 512)``, then steps of 256 up to
    ``max_capture_size``, itself defaulting to ``max_num_batched_tokens``
    capped at 4096); sizes are rounded to ``num_tokens_multiple`` (sequence
    parallelism pads steps to a multiple of the TP size) and capped at
    ``max_num_batched_tokens``. Uniform decode graphs go up to
    ``max_num_seqs`` requests; with ``uniform_decode_query_len`` ``q > 1``
    (speculative decoding, ``q = 1 + k``) and a separate decode routine,
    uniform graphs of ``q`` tokens a request are captured beside the
    one-token ones, for the capture sizes ``s <= max_num_seqs`` with ``q * s``
    within ``max_num_batched_tokens`` (and a multiple of ``num_tokens_multiple``).
    """

    def __init__(
        self,
        mode: CUDAGraphMode,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        capture_sizes: Iterable[int] | None = None,
        max_capture_size: int | None = None,
        num_tokens_multiple: int = 1,
        uniform_decode_query_len: int = 1,
    ) -> None:
        if uniform_decode_query_len < 1:
            raise ConfigError(
                f"uniform_decode_query_len must be >= 1, got {uniform_decode_query_len}"
            )
        self.mode = mode
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_tokens_multiple = num_tokens_multiple
        #: Query tokens per request of a speculative uniform decode batch (1: none).
        self.uniform_decode_query_len = uniform_decode_query_len
        if max_capture_size is None:
            max_capture_size = MAX_DEFAULT_CAPTURE_SIZE
        max_capture_size = min(max_capture_size, max_num_batched_tokens)
        sizes = (
            default_capture_sizes(max_capture_size, min(2 * max_num_seqs, 512))
            if capture_sizes is None
            else capture_sizes
        )
        m = num_tokens_multiple
        self.capture_sizes = sorted(
            {-(-s // m) * m for s in sizes if -(-s // m) * m <= max_num_batched_tokens}
        )
        self.full_keys: set[BatchDescriptor] = set()
        self.piecewise_keys: set[BatchDescriptor] = set()
        if mode is not CUDAGraphMode.NONE:
            self._init_keys()

    def _init_keys(self) -> None:
        mixed = self.mode.mixed_mode()
        for size in self.capture_sizes:
            if mixed is CUDAGraphMode.PIECEWISE:
                self.piecewise_keys.add(BatchDescriptor(size))
            elif mixed is CUDAGraphMode.FULL:
                num_reqs = min(size, self.max_num_seqs)
                self.full_keys.add(BatchDescriptor(size, num_reqs, uniform_decode=False))
        if self.mode.decode_mode() is CUDAGraphMode.FULL and self.mode.separate_decode_routine():
            for size in self.capture_sizes:
                if size <= self.max_num_seqs:
                    self.full_keys.add(BatchDescriptor(size, size, uniform_decode=True))
            q = self.uniform_decode_query_len
            if q > 1:
                for size in self._spec_decode_sizes():
                    self.full_keys.add(BatchDescriptor(q * size, size, uniform_decode=True))

    def _spec_decode_sizes(self) -> list[int]:
        """Request counts of the uniform graphs of ``uniform_decode_query_len``
        (> 1) tokens a request, ascending."""
        q, m = self.uniform_decode_query_len, self.num_tokens_multiple
        return [
            s
            for s in self.capture_sizes
            if s <= self.max_num_seqs and q * s <= self.max_num_batched_tokens and q * s % m == 0
        ]

    @property
    def max_capture_size(self) -> int:
        return self.capture_sizes[-1] if self.capture_sizes else 0

    @property
    def max_graph_tokens(self) -> int:
        """The most tokens any graph to capture holds (a uniform graph of
        several tokens a request may hold more than :attr:`max_capture_size`)."""
        keys = self.full_keys | self.piecewise_keys
        return max((k.num_tokens for k in keys), default=self.max_capture_size)

    def padded_num_tokens(self, num_tokens: int) -> int | None:
        """The smallest capture size holding ``num_tokens`` (None: too many)."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def dispatch(
        self, num_tokens: int, num_reqs: int, uniform_decode: bool
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and the (padded) descriptor to run this batch with.

        ``uniform_decode``: every request has exactly one query token
        (``num_tokens`` is ``num_reqs``, or that rounded up to
        ``num_tokens_multiple``), or exactly ``uniform_decode_query_len``
        (then ``num_tokens == uniform_decode_query_len * num_reqs``). A
        uniform batch of any other count must come as a mixed one
        (``uniform_decode`` False): its graph would be a one-token decode's."""
        unpadded = BatchDescriptor(num_tokens, num_reqs, uniform_decode)
        if self.mode is CUDAGraphMode.NONE:
            return CUDAGraphMode.NONE, unpadded
        if uniform_decode and num_reqs > 0:
            exact = self._uniform_key(num_tokens, num_reqs)
            if exact is not None and exact in self.full_keys:
                return CUDAGraphMode.FULL, exact
        padded = self.padded_num_tokens(num_tokens)
        if padded is None:
            return CUDAGraphMode.NONE, unpadded
        relaxed = BatchDescriptor(padded, min(padded, self.max_num_seqs), uniform_decode=False)
        if relaxed in self.full_keys and num_reqs <= (relaxed.num_reqs or 0):
            return CUDAGraphMode.FULL, relaxed
        piecewise = BatchDescriptor(padded)
        if piecewise in self.piecewise_keys:
            return CUDAGraphMode.PIECEWISE, piecewise
        return CUDAGraphMode.NONE, unpadded

    def _uniform_key(self, num_tokens: int, num_reqs: int) -> BatchDescriptor | None:
        """The uniform decode graph for ``num_reqs`` requests of ``num_tokens``
        tokens in all: of ``uniform_decode_query_len`` (> 1) tokens a request
        when ``num_tokens`` is exactly that many per request, padded in
        requests; else of one token a request (``num_tokens`` may be rounded
        up to ``num_tokens_multiple``), padded in tokens. None: too large."""
        q = self.uniform_decode_query_len
        if q > 1 and num_tokens == q * num_reqs:
            padded = self.padded_num_tokens(num_reqs)  # capture sizes count requests here
            return None if padded is None else BatchDescriptor(q * padded, padded, True)
        padded = self.padded_num_tokens(num_tokens)
        return None if padded is None else BatchDescriptor(padded, padded, True)

    def keys_to_capture(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every graph to capture, largest first (the shared memory pool
        then serves the smaller graphs from what the largest reserved)."""
        keys = [(CUDAGraphMode.FULL, k) for k in self.full_keys]
        keys += [(CUDAGraphMode.PIECEWISE, k) for k in self.piecewise_keys]
        return sorted(keys, key=lambda mk: (-mk[1].num_tokens, mk[0].value, mk[1].uniform_decode))


def resolve_cudagraph_mode(
    name: str, device: torch.device, backend: str, stand_in: bool = False
) -> CUDAGraphMode:
    """The configured mode, as far as the device and backend allow: NONE
    without CUDA (unless ``stand_in``); FULL graphs only with Triton
    attention (else their batches run PIECEWISE, or eagerly)."""
    mode = CUDAGraphMode.parse(name)
    if device.type != "cuda" and not stand_in:
        return CUDAGraphMode.NONE
    if backend == "triton" or not mode.has_full_cudagraphs():
        return mode
    fallback = {
        CUDAGraphMode.FULL: CUDAGraphMode.PIECEWISE,
        CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.PIECEWISE,
        CUDAGraphMode.FULL_DECODE_ONLY: CUDAGraphMode.NONE,
    }[mode]
    log.warning(
        "FULL CUDA graphs need the triton attention backend",
        cudagraph_mode=mode.name,
        using=fallback.name,
    )
    return fallback
