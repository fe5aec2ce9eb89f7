"""Data types shared by every room: requests' sampling parameters, the
scheduler's per-step output, the runner's per-step output, intermediate tensors.

:class:`SamplingParams` checks every field's type and range when built or
decoded (one check per field, in ``_FIELD_CHECKS``), so that nothing a request
holds can overflow a tensor, a generator's seed or the wire further on.

The wire types are msgspec Structs (typed, no pickle), so the same objects go
through an in-process memory channel or over a socket to another rank. This
module imports nothing heavy (no torch at run time), so every package may use it.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec.structs import force_setattr

from asyncstep.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

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


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request, vLLM's names and meanings.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 is off. ``stop`` holds
    strings that end the output (not included unless
    ``include_stop_str_in_output``); ``stop_token_ids`` end it too (EOS always
    does unless ``ignore_eos``). ``logprobs=n`` returns the top-n log-probs of
    each sampled position, plus the sampled token's (n <= ``MAX_LOGPROBS``).

    Every field is checked and normalized at construction (and when decoded):
    numbers become plain ``int`` / ``float`` (numpy scalars too; never a bool
    or a string), ``stop`` a tuple of strings (a lone string, a list, or None
    for none), ``stop_token_ids`` a tuple of ints. Anything else raises
    :class:`~asyncstep.errors.InvalidRequestError` naming the field
    (``msgspec.structs.replace`` checks too). A struct changed behind its
    back (``msgspec.structs.force_setattr``) is checked again by
    :meth:`validate`, which the engine calls for every request.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


# ---------------------------------------------------------------------------
# SamplingParams' field checks: (field name, value) -> the normalized value.


def shown(value: object, limit: int = 60) -> str:
    """A value in an error message: its repr, on one line and cut short."""
    try:
        text = repr(value).replace("\n", " ")
    except Exception:  # a caller's object whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _invalid(name: str, expected: str, value: object) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {expected}, got {shown(value)}")


def _as_int(name: str, value: object, expected: str) -> int:
    """``value`` as a plain int: ints and numpy integers, not bools."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _invalid(name, expected, value)
    return int(value)


def _as_float(name: str, value: object, expected: str) -> float:
    """``value`` as a plain float: ints, floats and numpy reals, not bools."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _invalid(name, expected, value)
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        raise _invalid(name, expected, value) from None


def _check_max_tokens(name: str, value: object) -> int:
    n = _as_int(name, value, "an integer")
    if n <= 0:
        raise InvalidRequestError(f"{name} must be at least 1, got {n}")
    if n > MAX_COUNT:
        raise _invalid(name, f"at most {MAX_COUNT} (2**63 - 1)", n)
    return n


def _check_temperature(name: str, value: object) -> float:
    expected = "a finite number >= 0"
    t = _as_float(name, value, expected)
    if not 0.0 <= t < math.inf:  # nan too
        raise _invalid(name, expected, t)
    return t


def _check_top_p(name: str, value: object) -> float:
    p = _as_float(name, value, "a number in (0, 1]")
    if not 0.0 < p <= 1.0:
        raise InvalidRequestError(f"{name} must be in (0, 1], got {p}")
    return p


def _check_min_p(name: str, value: object) -> float:
    p = _as_float(name, value, "a number in [0, 1]")
    if not 0.0 <= p <= 1.0:
        raise InvalidRequestError(f"{name} must be in [0, 1], got {p}")
    return p


def _check_top_k(name: str, value: object) -> int:
    k = _as_int(name, value, "an integer >= 1, or 0 / -1 for no top-k")
    if k < 0 and k not in TOP_K_OFF:
        raise InvalidRequestError(f"{name} must be >= 1, or 0 / -1 for no top-k, got {shown(k)}")
    if k > MAX_COUNT:
        raise _invalid(name, f"at most {MAX_COUNT} (2**63 - 1)", k)
    return k


def _check_seed(name: str, value: object) -> int | None:
    if value is None:
        return None
    expected = f"None or an integer in [0, {MAX_SEED}] (2**64 - 1)"
    seed = _as_int(name, value, expected)
    if not 0 <= seed <= MAX_SEED:
        raise _invalid(name, expected, seed)
    return seed


def _check_logprobs(name: str, value: object) -> int | None:
    if value is None:
        return None
    n = _as_int(name, value, f"None or an integer in [0, {MAX_LOGPROBS}]")
    if n < 0:
        raise InvalidRequestError(f"{name} must be >= 0, got {n}")
    if n > MAX_LOGPROBS:
        raise InvalidRequestError(f"{name} must be <= {MAX_LOGPROBS}, got {shown(n)}")
    return n


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _invalid(name, "True or False", value)
    return value


def _sequence(name: str, value: object, expected: str) -> tuple[object, ...]:
    """A list or tuple (or another sequence) as a tuple; None is empty."""
    if type(value) is tuple:  # the fast paths first: this runs per request
        return value
    if type(value) is list:
        return tuple(value)
    if value is None:
        return ()
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Sequence):
        raise _invalid(name, expected, value)
    return value if isinstance(value, tuple) else tuple(value)


def _check_stop(name: str, value: object) -> tuple[str, ...]:
    expected = "a string or a list of strings"
    items = (value,) if isinstance(value, str) else _sequence(name, value, expected)
    for item in items:
        if not isinstance(item, str):
            raise InvalidRequestError(f"{name} must hold strings only, got {shown(item)}")
        if not item:
            raise InvalidRequestError("stop strings must not be empty")
        if not is_utf8(item):
            raise InvalidRequestError(f"{name} string {shown(item)} is not valid UTF-8")
    return items  # type: ignore[return-value]  # checked above


def _check_token_ids(name: str, value: object) -> tuple[int, ...]:
    items = _sequence(name, value, "a list of token ids")
    if all(type(t) is int and 0 <= t <= MAX_COUNT for t in items):
        return items  # type: ignore[return-value]  # checked above
    ids = tuple(_as_int(name, t, "a list of integers only") for t in items)
    if any(not 0 <= t <= MAX_COUNT for t in ids):
        raise InvalidRequestError(f"{name} must be in [0, {MAX_COUNT}], got {shown(list(ids))}")
    return ids


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


#: The check of each SamplingParams field, in field order (a new field needs one:
#: tests/test_validation.py checks that every field has its check).
_FIELD_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": _check_max_tokens,
    "temperature": _check_temperature,
    "top_p": _check_top_p,
    "top_k": _check_top_k,
    "min_p": _check_min_p,
    "seed": _check_seed,
    "stop": _check_stop,
    "stop_token_ids": _check_token_ids,
    "ignore_eos": _check_flag,
    "logprobs": _check_logprobs,
    "include_stop_str_in_output": _check_flag,
}


class FinishReason(enum.StrEnum):
    """Why a request ended (vLLM's strings)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller, or the engine stopped


# ---------------------------------------------------------------------------
# Scheduler -> ranks


class NewRequestData(msgspec.Struct, frozen=True):
    """A request the runner has not seen (or sees again after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, frozen=True):
    """Per-step deltas of requests the runner already holds (parallel lists)."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    #: True: the request was preempted; ``new_block_ids`` replaces its blocks.
    resumed_from_preemption: list[bool] = msgspec.field(default_factory=list)
    #: Tokens this rank did not sample itself (pipeline stages that do not sample).
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class SchedulerOutput(msgspec.Struct, frozen=True):
    """What one step computes: which requests, how many tokens each."""

    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    #: req_id -> tokens scheduled this step (prompt chunk, or 1 when decoding).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    #: Requests that ended since the last step: the runner drops their state.
    finished_req_ids: list[str] = msgspec.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


# ---------------------------------------------------------------------------
# Ranks -> engine


class Logprobs(msgspec.Struct, frozen=True):
    """Log-probs of one sampled position: the sampled token first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    #: Rank of the sampled token among all tokens (1 = most likely).
    sampled_token_rank: int


class ModelRunnerOutput(msgspec.Struct, frozen=True):
    """What one step produced, per request (vLLM's ``ModelRunnerOutput``)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    #: One list per request: empty for a prompt chunk that is not the last.
    sampled_token_ids: list[list[int]]
    #: Per request, when asked for: one entry per sampled token.
    logprobs: list[list[Logprobs]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class IntermediateTensors:
    """Activations passed between pipeline stages (``hidden_states``, ``residual``)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)
