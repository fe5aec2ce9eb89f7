"""The sampler: one step's logits in, one token per request out (vLLM v1's ``Sampler``).

Holds :class:`SamplingMetadata` (the batch's sampling settings as tensors,
with the :class:`~asyncstep.runner.logits_processing.LogitsProcessing` its
rows ask for), :class:`LogprobsTensors` and :class:`SamplerOutput` (what a
step returns), the :class:`Sampler` and the small functions it is made of:
:func:`~asyncstep.runner.logits_processing.apply_logits_processing` (in its
own module), :func:`apply_temperature`,
:func:`apply_top_k_top_p`, :func:`apply_min_p`, :func:`random_sample`,
:func:`compute_logprobs` and :func:`gather_logprobs`.

Order of work, as in vLLM: log-probs of the *raw* logits (when asked for); then,
for the rows that ask, the logits processing (bad words, logit bias, min_tokens,
then the repetition, frequency and presence penalties), greedy rows too; greedy
rows take the argmax of the processed logits; random rows divide by their
temperature, keep the top-k, then the top-p nucleus, then drop tokens under
min-p, and sample with the exponential race ``argmax(probs / q)``,
``q ~ Exp(1)``, drawing ``q`` from the row's own generator when it has one.
Everything stays on the logits' device; the hot path has no host syncs and no
per-row Python loop except over seeded rows. A batch in which no row asks for
processing skips it whole (``SamplingMetadata.processing`` is None).

This module may import torch, numpy, :mod:`asyncstep.datatypes` and
:mod:`asyncstep.runner.logits_processing` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncstep.datatypes import GREEDY_EPSILON, Logprobs, SamplingParams
from asyncstep.runner.logits_processing import (
    LogitsProcessing,
    TokenHistory,
    apply_logits_processing,
    list_to_device,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_min_p",
    "apply_temperature",
    "apply_top_k_top_p",
    "compute_logprobs",
    "gather_logprobs",
    "random_sample",
]


@dataclass
class SamplingMetadata:
    """The sampling settings of one batch, one row per request.

    A filter's tensor is None when no row of the batch uses it, so the sampler
    skips it entirely. Rows that do not use a filter hold its "off" value:
    ``top_p`` 1.0, ``top_k`` <= 0, ``min_p`` 0.0. ``temperature`` holds every row's
    temperature (greedy rows below ``GREEDY_EPSILON``), None when all are greedy.
    """

    temperature: torch.Tensor | None  # [num_reqs] float32
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [num_reqs] float32
    top_k: torch.Tensor | None  # [num_reqs] int64
    min_p: torch.Tensor | None  # [num_reqs] float32
    #: Row index -> the request's own seeded generator (same object every step).
    generators: dict[int, torch.Generator]
    #: The most log-probs any row asked for; None when no row asked.
    max_num_logprobs: int | None
    #: Penalties, logit bias, min_tokens, bad words; None when no row asks for any.
    processing: LogitsProcessing | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row greedy, no log-probs, no logits processing: the
        sampled ids are the argmax of the logits as they are."""
        return self.all_greedy and self.max_num_logprobs is None and self.processing is None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: dict[int, torch.Generator],
        device: torch.device,
    ) -> SamplingMetadata:
        """Build the metadata of a batch whose row ``i`` samples with ``params[i]``.

        Filters count as used only by random rows; generators of greedy rows are
        left out (a greedy token needs no randomness, so its generator is not
        advanced).
        """
        greedy = [p.greedy for p in params]
        random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
        all_greedy = not random_params
        all_random = not any(greedy)

        def floats(values: list[float]) -> torch.Tensor:
            return list_to_device(values, torch.float32, device)

        temperature = None if all_greedy else floats([p.temperature for p in params])
        top_p = None
        if any(p.top_p < 1.0 for p in random_params):
            top_p = floats([p.top_p for p in params])
        top_k = None
        if any(p.top_k_enabled for p in random_params):
            top_k = list_to_device([_top_k_row(p.top_k) for p in params], torch.int64, device)
        min_p = None
        if any(p.min_p > 0.0 for p in random_params):
            min_p = floats([p.min_p for p in params])
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=temperature,
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            generators={i: g for i, g in generators.items() if not greedy[i]},
            max_num_logprobs=max(asked) if asked else None,
            processing=LogitsProcessing.from_params(params, device),
        )


#: Largest ``top_k`` a row's tensor holds: more than any vocabulary, far from int64's end.
TOP_K_CAP = 2**31 - 1


def _top_k_row(top_k: int) -> int:
    """A row's ``top_k`` clamped into ``[-1, TOP_K_CAP]`` (the filter then
    clamps to the vocabulary): SamplingParams allows any int64, and a value
    set behind its checks' back must not overflow the tensor either."""
    return max(-1, min(top_k, TOP_K_CAP))


@dataclass
class LogprobsTensors:
    """Log-probs of one sampled token per row: the sampled token first, then the top-k."""

    logprob_token_ids: torch.Tensor  # [n, k + 1] int64
    logprobs: torch.Tensor  # [n, k + 1] float32
    selected_token_ranks: torch.Tensor  # [n] int64, 1 = most likely

    def tolists(self) -> list[Logprobs]:
        """One :class:`~asyncstep.datatypes.Logprobs` per row (syncs with the device)."""
        ids = self.logprob_token_ids.tolist()
        values = self.logprobs.tolist()
        ranks = self.selected_token_ranks.tolist()
        return [
            Logprobs(token_ids=i, logprobs=v, sampled_token_rank=r)
            for i, v, r in zip(ids, values, ranks, strict=True)
        ]


@dataclass
class SamplerOutput:
    """One step's sampled tokens (on the logits' device) and, if asked, their log-probs."""

    sampled_token_ids: torch.Tensor  # [n] int64
    logprobs_tensors: LogprobsTensors | None


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature`` per row, as a new tensor.

    Greedy rows (temperature below ``GREEDY_EPSILON``) are divided by 1 instead:
    their result is thrown away, but must not turn into inf/nan.
    """
    safe = torch.where(temperature < GREEDY_EPSILON, 1.0, temperature)
    return logits / safe.unsqueeze(-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf all but each row's ``top_k`` largest logits, then all but its top-p nucleus.

    The nucleus is the smallest set of the most likely tokens whose probability
    (after top-k) reaches ``top_p``; it always holds the most likely token. Both
    filters share one descending sort. ``top_k`` <= 0 and ``top_p`` >= 1 are off.
    Ties are broken towards the lower token id. Returns a new tensor.
    """
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    logits_sort, logits_idx = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
        positions = torch.arange(vocab_size, device=logits.device)
        logits_sort.masked_fill_(positions >= k.unsqueeze(-1), float("-inf"))
    if top_p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        # Mass of the strictly more likely tokens: the top token's is 0 < top_p.
        mass_before = probs_sort.cumsum(dim=-1) - probs_sort
        outside = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
        logits_sort.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits_sort).scatter_(-1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (in place) tokens whose probability is below ``min_p`` times the row's highest."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, float("-inf"))


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row of ``probs`` with the exponential race ``argmax(probs / q)``.

    ``q ~ Exp(1)`` makes token ``i`` win with probability ``probs[i]``. Rows in
    ``generators`` draw their ``q`` row from their own generator, exactly one
    vocab-sized draw each; the rest from the default RNG. ``probs`` is overwritten.
    """
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for i, generator in generators.items():
        q[i].exponential_(generator=generator)
    # A zero draw would give 0 / 0 = nan for a filtered-out token, and argmax picks nan.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the vocabulary, in float32."""
    return logits.float().log_softmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """The sampled tokens' log-probs and ranks, then the top ``num_logprobs`` of
    each row (at most the whole vocabulary)."""
    num_logprobs = max(0, min(num_logprobs, logprobs.shape[-1]))
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    # (an int32 count: summing the comparison as int64 takes twice as long on the CPU)
    ranks = (logprobs > token_logprobs).sum(dim=-1, dtype=torch.int32).long() + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids, top_ids], dim=-1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=-1),
        selected_token_ranks=ranks,
    )


#: Logits per chunk of :func:`chunked_argmax`'s first stage.
ARGMAX_CHUNK = 256
#: Rows up to which a CUDA argmax takes the two stages (a few rows' single
#: reductions each run on few blocks; many rows fill the device anyway).
CHUNKED_ARGMAX_MAX_ROWS = 64


def chunked_argmax(logits: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D tensor in two stages: the maximum
    and its first index in each chunk of ``chunk`` columns (the last chunk
    padded with -inf), then the first chunk holding the row's maximum. The
    same index as ``argmax``, the lowest on ties, for any finite or
    infinite values (NaN: undefined)."""
    rows, vocab = logits.shape
    chunks = -(-vocab // chunk)
    pad = chunks * chunk - vocab
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    values, index = logits.reshape(rows, chunks, chunk).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)  # the first chunk holding the maximum
    return (best * chunk + index.gather(1, best)).squeeze(1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (lowest id on ties, the first NaN): on CUDA, for up
    to :data:`CHUNKED_ARGMAX_MAX_ROWS` rows of a long vocabulary,
    :func:`chunked_argmax` (torch's one reduction a row runs on one block
    a row, so one SM reads a whole long row); float32 on the CPU, numpy's
    (the same answer, several times faster than torch's there:
    benchmarks/studies/cpu_kernels/argmax_rows.py); else ``argmax``."""
    rows, vocab = logits.shape
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    if (
        logits.device.type == "cuda"
        and rows <= CHUNKED_ARGMAX_MAX_ROWS
        and vocab >= 4 * ARGMAX_CHUNK
    ):
        return chunked_argmax(logits)
    return logits.argmax(dim=-1)


class Sampler:
    """Samples one token per row of a ``[num_reqs, vocab]`` logits tensor.

    Works in float32 (an all-greedy batch without log-probs: the argmax of the
    logits as they are) and never modifies the caller's logits. Greedy rows get
    exactly ``argmax`` of the raw logits (lowest id on ties), mixed batch or not.
    """

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        history: TokenHistory | None = None,
    ) -> SamplerOutput:
        """``history``: the step's tokens, whenever ``metadata.processing``
        is not None (built by :meth:`InputBatch.token_history`)."""
        processing = metadata.processing
        if metadata.plain_greedy:
            # The argmax of any float dtype is that of its float32 values (exact);
            # the CPU's argmax of bf16/fp16 is not vectorized: float32 is faster there.
            if logits.device.type == "cpu":
                logits = logits.float()
            return SamplerOutput(sampled_token_ids=argmax_rows(logits), logprobs_tensors=None)
        # float() returns the same tensor when it is float32 already: no in-place ops on it.
        logits = logits.float()
        processed = logits
        if processing is not None:
            processed = apply_logits_processing(logits, processing, history)
        sampled = self.sample(processed, metadata)
        logprobs_tensors = None
        if metadata.max_num_logprobs is not None:
            # From the raw logits (vLLM's default), which nothing above modified.
            raw_logprobs = compute_logprobs(logits)
            logprobs_tensors = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs_tensors)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Token ids ``[num_reqs]`` int64 for float32 ``logits`` (left unmodified)."""
        if metadata.all_greedy:
            return argmax_rows(logits)
        greedy_sampled = None if metadata.all_random else argmax_rows(logits)

        temperature = metadata.temperature
        assert temperature is not None, "temperature is None only when all rows are greedy"
        logits = apply_temperature(logits, temperature)  # a new tensor from here on
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        random_sampled = random_sample(logits.softmax(dim=-1), metadata.generators)

        if greedy_sampled is None:
            return random_sampled
        return torch.where(temperature < GREEDY_EPSILON, greedy_sampled, random_sampled)
