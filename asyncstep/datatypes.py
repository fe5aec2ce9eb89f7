"""Data types shared by every room: requests' sampling parameters, the
scheduler's per-step output, the runner's per-step output, intermediate tensors.

The wire types are msgspec Structs (typed, no pickle), so the same objects go
through an in-process memory channel or over a socket to another rank. This
module imports nothing heavy (no torch at run time), so every package may use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
from msgspec.structs import force_setattr

from asyncstep.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

#: ``top_k`` values that switch top-k filtering off.
TOP_K_OFF = (0, -1)
#: Temperatures below this sample greedily.
GREEDY_EPSILON = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to sample one request, vLLM's names and meanings.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 is off. ``stop`` holds
    strings that end the output (not included unless
    ``include_stop_str_in_output``); ``stop_token_ids`` end it too (EOS always
    does unless ``ignore_eos``). ``logprobs=n`` returns the top-n log-probs of
    each sampled position, plus the sampled token's. Invalid values raise
    :class:`~asyncstep.errors.InvalidRequestError` at construction.
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
        # Accept a lone string or any iterable for the tuple fields.
        if isinstance(self.stop, str):
            force_setattr(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            force_setattr(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0 or self.temperature == float("inf"):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 and self.top_k not in TOP_K_OFF:
            raise bad(f"top_k must be >= 1, or 0 / -1 for no top-k, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad(f"logprobs must be >= 0, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise bad("stop strings must not be empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0


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
