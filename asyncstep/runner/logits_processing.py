"""The logits processing some requests ask for, before the sampler's
filters (vLLM v1's logits processors): bad words, logit bias, ``min_tokens``,
then the repetition, frequency and presence penalties.

Holds :class:`LogitsProcessing` (what a batch's rows ask for, built once
while its rows hold the same requests), :class:`TokenHistory` (the step's
tokens that needs), :func:`apply_logits_processing` and its parts
(:func:`apply_bad_word_prefixes`, :func:`apply_min_tokens`,
:func:`apply_penalties`), and :func:`to_device` / :func:`list_to_device` (a
small host array or list on the device without a host sync). Greedy rows are
processed too; everything stays on the logits' device.

This module may import torch, numpy and :mod:`asyncstep.datatypes` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from asyncstep.datatypes import SamplingParams

__all__ = [
    "BadWordPrefixes",
    "LogitsProcessing",
    "MinTokens",
    "TokenHistory",
    "apply_bad_word_prefixes",
    "apply_logits_processing",
    "apply_min_tokens",
    "apply_penalties",
    "list_to_device",
    "to_device",
]


def list_to_device(
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
    """A host array on the device without a host sync (as :func:`list_to_device`);
    on the CPU the tensor shares the array's memory."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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
            return list_to_device(values, torch.float32, device)

        return cls(
            history_rows=np.asarray(history, dtype=np.int64),
            history_index=(
                None
                if history == list(range(len(params)))
                else list_to_device(history, torch.int64, device)
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
        list_to_device(rows, torch.int64, device),
        list_to_device(ids, torch.int64, device),
        list_to_device(values, torch.float32, device),
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
        rows=list_to_device([i for i, _ in prefixes], torch.int64, device),
        history=list_to_device([position[i] for i, _ in prefixes], torch.int64, device),
        prefix_ids=to_device(np.asarray(padded, dtype=np.int64), device),
        prefix_lens=list_to_device([len(seq) - 1 for _, seq in prefixes], torch.int64, device),
        last_ids=list_to_device([seq[-1] for _, seq in prefixes], torch.int64, device),
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
