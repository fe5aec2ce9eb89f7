"""The sampler: one step's logits in, one token per request out (vLLM v1's ``Sampler``).

Holds :class:`SamplingMetadata` (the batch's sampling settings as tensors)
with its :class:`LogitsProcessing` (penalties, logit bias, min_tokens, bad
words), :class:`TokenHistory` (the step's tokens those need),
:class:`LogprobsTensors` and :class:`SamplerOutput` (what a step returns), the
:class:`Sampler` and the small functions it is made of:
:func:`apply_logits_processing` (:func:`apply_bad_word_prefixes`,
:func:`apply_min_tokens`, :func:`apply_penalties`), :func:`apply_temperature`,
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

This module may import torch, numpy and :mod:`asyncstep.datatypes` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.datatypes import GREEDY_EPSILON, Logprobs, SamplingParams

__all__ = [
    "BadWordPrefixes",
    "LogitsProcessing",
    "LogprobsTensors",
    "MinTokens",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "TokenHistory",
    "apply_bad_word_prefixes",
    "apply_logits_processing",
    "apply_min_p",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p",
    "compute_logprobs",
    "gather_logprobs",
    "random_sample",
    "to_device",
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
            return _to_device(values, torch.float32, device)

        temperature = None if all_greedy else floats([p.temperature for p in params])
        top_p = None
        if any(p.top_p < 1.0 for p in random_params):
            top_p = floats([p.top_p for p in params])
        top_k = None
        if any(p.top_k_enabled for p in random_params):
            top_k = _to_device([_top_k_row(p.top_k) for p in params], torch.int64, device)
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


@dataclass
class BadWordPrefixes:
    """Bad words of several tokens, one entry per (row, word): the word's
    last token is banned where the row's output ends with the others."""

    rows: torch.Tensor  # [e] int64: sample rows
    #: Each entry's row among the history rows (:attr:`LogitsProcessing.history_rows`).
    history: torch.Tensor  # [e] int64
    prefix_ids: torch.Tensor  # [e, p] int64, -1 past an entry's prefix
    prefix_lens: torch.Tensor  # [e] int64, >= 1
    last_ids: torch.Tensor  # [e] int64


@dataclass
class MinTokens:
    """``min_tokens``: the tokens to ban (EOS, stop ids) while a row has
    fewer outputs than its ``min_tokens``, one host entry per (row, token)."""

    rows: np.ndarray  # [e] int64: sample rows
    token_ids: np.ndarray  # [e] int64
    min_tokens: np.ndarray  # [e] int64: the row's min_tokens


@dataclass
class LogitsProcessing:
    """What the logits processors of a batch need that stays the same while
    its rows hold the same requests (built and cached with the metadata).
    The tokens of each step come apart, in a :class:`TokenHistory`. Rows are
    sample rows (rows of the logits); a part is None when no row uses it."""

    #: Sample rows whose tokens the step needs (penalties, or bad words of
    #: several tokens), ascending.
    history_rows: np.ndarray  # [h] int64
    #: ``history_rows`` on the device; None when they are every row, in order.
    history_index: torch.Tensor | None
    #: The penalties of the history rows (neutral for a row without them).
    presence_penalty: torch.Tensor | None  # [h] float32
    frequency_penalty: torch.Tensor | None  # [h] float32
    repetition_penalty: torch.Tensor | None  # [h] float32
    #: ``logits[rows, ids] += values``: logit bias, and -inf for one-token bad words.
    sparse_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    bad_word_prefixes: BadWordPrefixes | None
    min_tokens: MinTokens | None

    @property
    def needs_token_ids(self) -> bool:
        """Whether the step's :class:`TokenHistory` must hold token ids (else
        only the output counts)."""
        return len(self.history_rows) > 0

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], device: torch.device
    ) -> LogitsProcessing | None:
        """The processing of a batch whose row ``i`` samples with ``params[i]``;
        None when no row asks for any."""
        if not any(p.processes_logits for p in params):
            return None
        prefixes = [
            (i, seq) for i, p in enumerate(params) for seq in p.bad_words_token_ids if len(seq) > 1
        ]
        penalized = {i for i, p in enumerate(params) if p.has_penalties}
        history = sorted(penalized | {i for i, _ in prefixes})
        history_params = [params[i] for i in history]

        def per_history_row(name: str, neutral: float) -> torch.Tensor | None:
            values = [getattr(p, name) for p in history_params]
            if all(v == neutral for v in values):
                return None
            return _to_device(values, torch.float32, device)

        return cls(
            history_rows=np.asarray(history, dtype=np.int64),
            history_index=(
                None
                if history == list(range(len(params)))
                else _to_device(history, torch.int64, device)
            ),
            presence_penalty=per_history_row("presence_penalty", 0.0),
            frequency_penalty=per_history_row("frequency_penalty", 0.0),
            repetition_penalty=per_history_row("repetition_penalty", 1.0),
            sparse_bias=_sparse_bias(params, device),
            bad_word_prefixes=_bad_word_prefixes(prefixes, history, device),
            min_tokens=_min_tokens(params),
        )


def _sparse_bias(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(i)
            ids.append(token_id)
            values.append(bias)
        for seq in p.bad_words_token_ids:
            if len(seq) == 1:
                rows.append(i)
                ids.append(seq[0])
                values.append(float("-inf"))
    if not rows:
        return None
    return (
        _to_device(rows, torch.int64, device),
        _to_device(ids, torch.int64, device),
        _to_device(values, torch.float32, device),
    )


def _bad_word_prefixes(
    prefixes: list[tuple[int, tuple[int, ...]]], history: list[int], device: torch.device
) -> BadWordPrefixes | None:
    if not prefixes:
        return None
    position = {row: k for k, row in enumerate(history)}
    width = max(len(seq) - 1 for _, seq in prefixes)
    padded = [list(seq[:-1]) + [-1] * (width - len(seq) + 1) for _, seq in prefixes]
    return BadWordPrefixes(
        rows=_to_device([i for i, _ in prefixes], torch.int64, device),
        history=_to_device([position[i] for i, _ in prefixes], torch.int64, device),
        prefix_ids=to_device(np.asarray(padded, dtype=np.int64), device),
        prefix_lens=_to_device([len(seq) - 1 for _, seq in prefixes], torch.int64, device),
        last_ids=_to_device([seq[-1] for _, seq in prefixes], torch.int64, device),
    )


def _min_tokens(params: Sequence[SamplingParams]) -> MinTokens | None:
    entries = [
        (i, token_id, p.min_tokens)
        for i, p in enumerate(params)
        if p.min_tokens > 0
        for token_id in sorted(p.min_tokens_stop_ids)
    ]
    if not entries:
        return None
    rows, ids, counts = np.asarray(entries, dtype=np.int64).T
    return MinTokens(rows=rows, token_ids=ids, min_tokens=counts)


@dataclass
class TokenHistory:
    """One step's tokens, as the logits processing needs them."""

    #: Outputs each sample row has before this step's token (host); None
    #: when no row has ``min_tokens``.
    num_output_tokens: np.ndarray | None  # [n] int64
    #: The history rows' tokens, prompt then output (positions from
    #: ``seq_lens`` on hold anything); None when there are no history rows.
    token_ids: torch.Tensor | None  # [h, L] int64
    seq_lens: torch.Tensor | None  # [h] int64
    num_prompt_tokens: torch.Tensor | None  # [h] int64


#: Largest ``top_k`` a row's tensor holds: more than any vocabulary, far from int64's end.
TOP_K_CAP = 2**31 - 1


def _top_k_row(top_k: int) -> int:
    """A row's ``top_k`` clamped into ``[-1, TOP_K_CAP]`` (the filter then
    clamps to the vocabulary): SamplingParams allows any int64, and a value
    set behind its checks' back must not overflow the tensor either."""
    return max(-1, min(top_k, TOP_K_CAP))


def _to_device(
    values: list[float] | list[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list on the device without a host sync: a plain
    ``torch.tensor(..., device=cuda)`` would wait for the whole stream (the
    forward still running there). Pinned memory comes from torch's caching
    host allocator, which keeps it until the copy is done."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without a host sync (as :func:`_to_device`);
    on the CPU the tensor shares the array's memory."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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


def apply_logits_processing(
    logits: torch.Tensor, processing: LogitsProcessing, history: TokenHistory | None
) -> torch.Tensor:
    """The processed logits, as a new tensor (``logits`` float32, left as
    they are): bad words and logit bias, min_tokens, then the penalties
    (vLLM's order: the penalties see the biased logits, as in HF's
    ``generate``)."""
    logits = logits.clone()
    if processing.sparse_bias is not None:
        rows, ids, values = processing.sparse_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if processing.bad_word_prefixes is not None:
        history = _need_history(history)
        apply_bad_word_prefixes(logits, processing.bad_word_prefixes, history)
    if processing.min_tokens is not None:
        num_output_tokens = _need_history(history).num_output_tokens
        assert num_output_tokens is not None, "min_tokens needs num_output_tokens"
        apply_min_tokens(logits, processing.min_tokens, num_output_tokens)
    presence = processing.presence_penalty
    frequency = processing.frequency_penalty
    repetition = processing.repetition_penalty
    if presence is None and frequency is None and repetition is None:
        return logits
    history = _need_history(history)
    assert history.token_ids is not None and history.seq_lens is not None
    assert history.num_prompt_tokens is not None
    return apply_penalties(
        logits,
        history.token_ids,
        history.seq_lens,
        history.num_prompt_tokens,
        rows=processing.history_index,
        presence=presence,
        frequency=frequency,
        repetition=repetition,
    )


def _need_history(history: TokenHistory | None) -> TokenHistory:
    if history is None:
        raise RuntimeError("this batch's logits processing needs the step's TokenHistory")
    return history


def apply_bad_word_prefixes(
    logits: torch.Tensor, prefixes: BadWordPrefixes, history: TokenHistory
) -> None:
    """Ban (in place) each multi-token bad word's last token in the rows
    whose output ends with the word's other tokens (vLLM's rule: the prompt
    does not count)."""
    tokens, seq_lens, num_prompt = history.token_ids, history.seq_lens, history.num_prompt_tokens
    assert tokens is not None and seq_lens is not None and num_prompt is not None
    row_seq_lens = seq_lens[prefixes.history]
    start = row_seq_lens - prefixes.prefix_lens  # where the prefix would begin
    offsets = torch.arange(prefixes.prefix_ids.shape[1], device=logits.device)
    positions = (start.unsqueeze(1) + offsets).clamp(min=0, max=tokens.shape[1] - 1)
    found = tokens[prefixes.history].gather(1, positions)
    inside = offsets < prefixes.prefix_lens.unsqueeze(1)
    matched = ((found == prefixes.prefix_ids) | ~inside).all(dim=1)
    matched &= start >= num_prompt[prefixes.history]
    ban = torch.where(matched, float("-inf"), 0.0)
    logits.index_put_((prefixes.rows, prefixes.last_ids), ban, accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor, min_tokens: MinTokens, num_output_tokens: np.ndarray
) -> None:
    """Ban (in place) EOS and the stop ids of rows with fewer outputs than
    their ``min_tokens`` (ids past the vocabulary cannot be sampled anyway)."""
    active = num_output_tokens[min_tokens.rows] < min_tokens.min_tokens
    active &= min_tokens.token_ids < logits.shape[-1]
    if not active.any():
        return
    device = logits.device
    rows = to_device(min_tokens.rows[active], device)
    ids = to_device(min_tokens.token_ids[active], device)
    logits.index_put_((rows, ids), logits.new_full((), float("-inf")))


def apply_penalties(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    num_prompt_tokens: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    presence: torch.Tensor | None,
    frequency: torch.Tensor | None,
    repetition: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's penalties, in place (returns ``logits``), on the logits rows
    ``rows`` (None: every row), each with its own penalties (tensors of one
    value per row of ``rows``):
    ``repetition`` divides the positive logits of the tokens in the prompt
    or the output and multiplies the others; then ``logits -= frequency *
    count`` and ``logits -= presence * (count > 0)``, ``count`` a token's
    occurrences in the output. vLLM's arithmetic, element for element.

    ``token_ids[i, :seq_lens[i]]`` is the prompt (its first
    ``num_prompt_tokens[i]``) and output so far of the ``i``-th row. Only the logits of those
    tokens are read and written (a gather and a scatter over the rows'
    tokens, not over the vocabulary): each row's tokens are sorted, and
    the occurrences of a token are counted over its run."""
    positions = torch.arange(token_ids.shape[1], device=logits.device)
    in_sequence = positions < seq_lens.unsqueeze(1)
    in_output = in_sequence & (positions >= num_prompt_tokens.unsqueeze(1))
    # Past a row's end: its first token again (a real token, counted 0 times there).
    ids = torch.where(in_sequence, token_ids, token_ids[:, :1])
    ids, order = ids.sort(dim=1)
    if rows is None:
        values = logits.gather(1, ids)
    else:
        row_of = rows.unsqueeze(1).expand_as(ids)
        values = logits[row_of, ids]
    if repetition is not None:
        factor = repetition.unsqueeze(1)
        values = torch.where(values > 0, values / factor, values * factor)
    if presence is not None or frequency is not None:
        counts = _run_counts(ids, in_output.gather(1, order).to(logits.dtype))
        if frequency is not None:
            values = values - frequency.unsqueeze(1) * counts
        if presence is not None:
            values = values - presence.unsqueeze(1) * (counts > 0).to(logits.dtype)
    # A token's every copy holds the same value: the scatter writes it once, whichever wins.
    if rows is None:
        return logits.scatter_(1, ids, values)
    return logits.index_put_((row_of, ids), values)


def _run_counts(sorted_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per position of each row of ``sorted_ids``, the sum of ``weights``
    over the run of equal ids it belongs to."""
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run = starts.cumsum(dim=1) - 1
    sums = torch.zeros_like(weights).scatter_add_(1, run, weights)
    return sums.gather(1, run)


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
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        logprob_token_ids=torch.cat([token_ids, top_ids], dim=-1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=-1),
        selected_token_ranks=ranks,
    )


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
        if metadata.all_greedy and metadata.max_num_logprobs is None and processing is None:
            # The argmax of any float dtype is that of its float32 values (exact).
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs_tensors=None)
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
            return logits.argmax(dim=-1)
        greedy_sampled = None if metadata.all_random else logits.argmax(dim=-1)

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
