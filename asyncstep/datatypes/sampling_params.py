"""A request's sampling parameters: :class:`SamplingParams`, which checks
every field's type and range when built or decoded (one check per field, in
``_FIELD_CHECKS``), so that nothing a request holds can overflow a tensor, a
generator's seed or the wire further on; and the bounds it checks against.
Imports :mod:`asyncstep.checks`, :mod:`asyncstep.errors` and
:mod:`asyncstep.structured_params` only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from asyncstep.checks import as_float, as_int, check_flag, invalid, sequence, shown, strings
from asyncstep.errors import InvalidRequestError
from asyncstep.structured_params import StructuredOutputsParams, check_structured_outputs

#: ``top_k`` values that switch top-k filtering off.
TOP_K_OFF = (0, -1)
#: Temperatures below this sample greedily.
GREEDY_EPSILON = 1e-5
#: Most log-probs a request may ask for per position (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: Largest count (``max_tokens``, ``top_k``, a stop token id): an int64.
MAX_COUNT = 2**63 - 1
#: Largest ``seed``: a uint64 (what ``torch.Generator.manual_seed`` takes).
MAX_SEED = 2**64 - 1
#: ``presence_penalty`` and ``frequency_penalty`` lie in ``[-MAX_PENALTY, MAX_PENALTY]``.
MAX_PENALTY = 2.0
#: Most choices one request may ask for (``n``).
MAX_N = 128
#: A ``logit_bias`` value is clamped into ``[-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]`` (as vLLM's
#: OpenAI server does).
MAX_LOGIT_BIAS = 100.0


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request, vLLM's names and meanings.

    ``n`` independent choices of the prompt (at most ``MAX_N``; its KV
    blocks computed once and shared through the prefix cache; with a
    ``seed``, choice ``i`` samples with ``seed + i``). ``max_tokens``: the
    most tokens generated; the prompt and they must fit the model's context
    (``max_model_len``: the engine refuses a request that asks for more, as
    vLLM does); None: as many as the context leaves. ``temperature == 0``
    is greedy. ``top_k`` of 0 or -1 is off. ``stop`` holds
    strings that end the output (not included unless
    ``include_stop_str_in_output``); ``stop_token_ids`` end it too (EOS always
    does unless ``ignore_eos``). ``logprobs=n`` returns the top-n log-probs of
    each sampled position, plus the sampled token's (n <= ``MAX_LOGPROBS``),
    of the logits before any of the processing below (vLLM's raw log-probs).
    ``prompt_logprobs=k`` returns, for every prompt position but the first
    (None there), the log-prob of the prompt's token plus the top-k of that
    position (k <= ``MAX_LOGPROBS``; 0: the prompt token's alone), raw too;
    such a request computes its whole prompt (no prefix-cache hit).

    Logits processing, before temperature and the filters, greedy rows too
    (vLLM's order): ``bad_words`` (a word's tokens, tokenized by the front end
    with and without a leading space; a one-token word is banned always, a
    longer one's last token when the output ends with the others), then
    ``logit_bias`` (token id -> a value added to its logit, clamped into
    [-100, 100]), then ``min_tokens`` (EOS and ``stop_token_ids`` banned until
    that many tokens are out; stop strings are ignored until then too), then
    the penalties: ``repetition_penalty`` (> 0; divides a positive logit of a
    token in the prompt or the output, multiplies a negative one),
    ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2]; subtract
    ``frequency * count + presence * (count > 0)``, ``count`` the token's
    occurrences in the output).

    ``structured_outputs`` (a :class:`StructuredOutputsParams`, or a dict
    of its fields): the output follows a JSON schema, any JSON object, a
    regex, one of a list of strings, or an EBNF grammar; each step's tokens
    outside it are masked before the logits processing above.

    ``_bad_words_token_ids`` and ``_eos_token_ids`` are filled in by the
    engine at its door (what ``bad_words`` tokenizes to; the model's EOS ids,
    which ``min_tokens`` bans): a caller leaves them empty (with no
    ``bad_words``, token-id sequences given in ``_bad_words_token_ids`` are
    banned as they are, like HF's ``bad_words_ids``).

    Every field is checked and normalized at construction (and when decoded):
    numbers become plain ``int`` / ``float`` (numpy scalars too; never a bool
    or a string), ``stop`` a tuple of strings (a lone string, a list, or None
    for none), ``stop_token_ids`` a tuple of ints. Anything else raises
    :class:`~asyncstep.errors.InvalidRequestError` naming the field
    (``msgspec.structs.replace`` checks too). A struct changed behind its
    back (``msgspec.structs.force_setattr``) is checked again by
    :meth:`validate`, which the engine calls for every request.
    """

    n: int = 1
    max_tokens: int | None = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    structured_outputs: StructuredOutputsParams | None = None
    _bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    _eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check and normalize every field in place (idempotent); raises
        :class:`~asyncstep.errors.InvalidRequestError` on the first bad one."""
        for name, check in _FIELD_CHECKS.items():
            value = getattr(self, name)
            checked = check(name, value)
            if checked is not value:
                force_setattr(self, name, checked)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...]:
        """The token-id sequences banned (``bad_words`` as the front end tokenized them)."""
        return self._bad_words_token_ids

    @property
    def min_tokens_stop_ids(self) -> frozenset[int]:
        """The tokens banned while fewer than ``min_tokens`` are out: EOS and ``stop_token_ids``."""
        return frozenset(self.stop_token_ids) | frozenset(self._eos_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def speculates(self) -> bool:
        """Whether a step may verify draft tokens for this request (no
        logits processing, no prompt log-probs)."""
        return not self.processes_logits and self.prompt_logprobs is None

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before sampling
        (penalties, logit bias, min_tokens, bad words)."""
        return (
            self.has_penalties
            or self.logit_bias is not None
            or self.min_tokens > 0
            or bool(self._bad_words_token_ids)
        )


# ---------------------------------------------------------------------------
# SamplingParams' field checks: (field name, value) -> the normalized value.


def _check_max_tokens(name: str, value: object) -> int | None:
    if value is None:  # as many as the context leaves
        return None
    n = as_int(name, value, "an integer")
    if n <= 0:
        raise InvalidRequestError(f"{name} must be at least 1, got {n}")
    if n > MAX_COUNT:
        raise invalid(name, f"at most {MAX_COUNT} (2**63 - 1)", n)
    return n


def _check_temperature(name: str, value: object) -> float:
    expected = "a finite number >= 0"
    t = as_float(name, value, expected)
    if not 0.0 <= t < math.inf:  # nan too
        raise invalid(name, expected, t)
    return t


def _check_top_p(name: str, value: object) -> float:
    p = as_float(name, value, "a number in (0, 1]")
    if not 0.0 < p <= 1.0:
        raise InvalidRequestError(f"{name} must be in (0, 1], got {p}")
    return p


def _check_min_p(name: str, value: object) -> float:
    p = as_float(name, value, "a number in [0, 1]")
    if not 0.0 <= p <= 1.0:
        raise InvalidRequestError(f"{name} must be in [0, 1], got {p}")
    return p


def _check_top_k(name: str, value: object) -> int:
    k = as_int(name, value, "an integer >= 1, or 0 / -1 for no top-k")
    if k < 0 and k not in TOP_K_OFF:
        raise InvalidRequestError(f"{name} must be >= 1, or 0 / -1 for no top-k, got {shown(k)}")
    if k > MAX_COUNT:
        raise invalid(name, f"at most {MAX_COUNT} (2**63 - 1)", k)
    return k


def _check_seed(name: str, value: object) -> int | None:
    if value is None:
        return None
    expected = f"None or an integer in [0, {MAX_SEED}] (2**64 - 1)"
    seed = as_int(name, value, expected)
    if not 0 <= seed <= MAX_SEED:
        raise invalid(name, expected, seed)
    return seed


def _check_logprobs(name: str, value: object) -> int | None:
    if value is None:
        return None
    n = as_int(name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")
    if n < 0:
        raise InvalidRequestError(f"{name} must be >= 0, got {n}")
    if n > MAX_LOGPROBS:
        raise InvalidRequestError(f"{name} must be <= {MAX_LOGPROBS}, got {shown(n)}")
    return n


def _check_penalty(name: str, value: object) -> float:
    expected = f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    penalty = as_float(name, value, expected)
    if not -MAX_PENALTY <= penalty <= MAX_PENALTY:  # nan too
        raise InvalidRequestError(f"{name} must be in [-2, 2], got {shown(penalty)}")
    return penalty


def _check_repetition_penalty(name: str, value: object) -> float:
    expected = "a finite number > 0"
    penalty = as_float(name, value, expected)
    if not 0.0 < penalty < math.inf:
        raise invalid(name, expected, penalty)
    return penalty


def _check_n(name: str, value: object) -> int:
    n = as_int(name, value, "an integer >= 1")
    if not 1 <= n <= MAX_N:
        raise invalid(name, f"an integer in [1, {MAX_N}]", n)
    return n


def _check_min_tokens(name: str, value: object) -> int:
    n = as_int(name, value, "an integer >= 0")
    if not 0 <= n <= MAX_COUNT:
        raise invalid(name, f"an integer in [0, {MAX_COUNT}]", n)
    return n


def _check_logit_bias(name: str, value: object) -> dict[int, float] | None:
    """Token id -> bias, each bias clamped into [-100, 100]; None (or empty): none."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise invalid(name, "None or a dict of token id -> bias", value)
    if not value:
        return None
    checked: dict[int, float] = {}
    for token_id, bias in value.items():
        token = as_int(name, token_id, "a dict whose keys are token ids (ints)")
        if not 0 <= token <= MAX_COUNT:
            raise InvalidRequestError(f"{name} token ids must be >= 0, got {shown(token)}")
        b = as_float(name, bias, "a dict whose values are finite numbers")
        if not math.isfinite(b):
            raise InvalidRequestError(f"{name}[{token}] must be a finite number, got {b}")
        checked[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b))
    return checked


def _check_token_sequences(name: str, value: object) -> tuple[tuple[int, ...], ...]:
    """A list of non-empty lists of token ids, as tuples."""
    items = sequence(name, value, "a list of token-id lists")
    if all(
        type(s) is tuple and s and all(type(t) is int and 0 <= t <= MAX_COUNT for t in s)
        for s in items
    ):
        return items  # type: ignore[return-value]  # checked above
    sequences = tuple(_check_token_ids(name, s) for s in items)
    if not all(sequences):
        raise InvalidRequestError(f"{name} must not hold an empty sequence")
    return sequences


def _check_stop(name: str, value: object) -> tuple[str, ...]:
    return strings(name, value, lambda s: not s, "stop strings")


def _check_bad_words(name: str, value: object) -> tuple[str, ...]:
    """Words (a lone string is one word); one of spaces only would tokenize to nothing."""
    return strings(name, value, lambda s: not s.strip(), "bad_words")


def _check_token_ids(name: str, value: object) -> tuple[int, ...]:
    items = sequence(name, value, "a list of token ids")
    if all(type(t) is int and 0 <= t <= MAX_COUNT for t in items):
        return items  # type: ignore[return-value]  # checked above
    ids = tuple(as_int(name, t, "a list of integers only") for t in items)
    if any(not 0 <= t <= MAX_COUNT for t in ids):
        raise InvalidRequestError(f"{name} must be in [0, {MAX_COUNT}], got {shown(list(ids))}")
    return ids


#: The check of each SamplingParams field, in field order (a new field needs one:
#: tests/engine/test_validation.py checks that every field has its check).
_FIELD_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "n": _check_n,
    "max_tokens": _check_max_tokens,
    "temperature": _check_temperature,
    "top_p": _check_top_p,
    "top_k": _check_top_k,
    "min_p": _check_min_p,
    "seed": _check_seed,
    "stop": _check_stop,
    "stop_token_ids": _check_token_ids,
    "ignore_eos": check_flag,
    "logprobs": _check_logprobs,
    "prompt_logprobs": _check_logprobs,
    "include_stop_str_in_output": check_flag,
    "presence_penalty": _check_penalty,
    "frequency_penalty": _check_penalty,
    "repetition_penalty": _check_repetition_penalty,
    "logit_bias": _check_logit_bias,
    "min_tokens": _check_min_tokens,
    "bad_words": _check_bad_words,
    "structured_outputs": check_structured_outputs,
    "_bad_words_token_ids": _check_token_sequences,
    "_eos_token_ids": _check_token_ids,
}
