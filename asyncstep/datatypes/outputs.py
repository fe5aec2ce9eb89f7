"""What the ranks send the engine each step (vLLM's ``vllm/v1/outputs.py``):
:class:`ModelRunnerOutput` with its :class:`Logprobs`, and why a request
ended (:class:`FinishReason`). Imports msgspec only.
"""

from __future__ import annotations

import enum

import msgspec


class FinishReason(enum.StrEnum):
    """Why a request ended (vLLM's strings)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller, or the engine stopped


class Logprobs(msgspec.Struct, frozen=True):
    """Log-probs of one position: the sampled token (or, for prompt log-probs,
    the prompt's token) first, then the top-n."""

    token_ids: list[int]
    logprobs: list[float]
    #: Rank of the first token among all tokens (1 = most likely).
    sampled_token_rank: int


class ModelRunnerOutput(msgspec.Struct, frozen=True):
    """What one step produced, per request (vLLM's ``ModelRunnerOutput``)."""

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    #: One list per request: empty for a prompt chunk that is not the last;
    #: with draft tokens, the accepted drafts then one token of the target
    #: model (``1 + accepted`` tokens).
    sampled_token_ids: list[list[int]]
    #: Per request, when asked for: one entry per sampled token.
    logprobs: list[list[Logprobs]] | None = None
    #: Request id -> the prompt log-probs of the prompt positions this step
    #: computed, in order (positions >= 1 not returned before); None: none asked.
    prompt_logprobs: dict[str, list[Logprobs]] | None = None
    #: ``draft_model`` speculation: request id -> the draft tokens the draft
    #: model proposes to follow this step's tokens (None: none proposed).
    draft_token_ids: dict[str, list[int]] | None = None
    #: A MoE model: the token rows routed to each expert in this step, summed
    #: over the MoE layers of the stage that sends the output (None: no MoE).
    expert_tokens: list[int] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
