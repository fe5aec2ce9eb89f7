"""What a step's tokens cost against the scheduler's token budget, and how
many fit in what is left of it.

A token costs one; a prompt token whose row gives a prompt position's
log-probs (its request asks for ``prompt_logprobs``) costs
:data:`PROMPT_LOGPROBS_TOKEN_COST`. :func:`num_tokens_within` is the inverse
of :func:`budget_cost`: the most tokens whose cost fits a budget.

Pure Python; may import only the engine's ``request`` module.
"""

from __future__ import annotations

from asyncstep.engine.core.request import Request

#: The token budget one prompt token takes when its request asks for
#: ``prompt_logprobs``: the token itself, and its row of the LM head over the
#: vocabulary with that row's log-softmax, rank and top-k (a healthy stream
#: beside such a prompt keeps its pace; ``benchmarks/studies/prompt_logprobs_cost/README.md``).
PROMPT_LOGPROBS_TOKEN_COST = 2


def num_prompt_logprobs_rows(request: Request, num_computed: int, num_new: int) -> int:
    """Of ``num_new`` tokens from ``num_computed``, those whose rows give
    a prompt position's log-probs (the last prompt token's samples)."""
    if request.sampling_params.prompt_logprobs is None:
        return 0
    return max(0, min(num_new, request.num_prompt_tokens - 1 - num_computed))


def budget_cost(request: Request, num_computed: int, num_new: int) -> int:
    """The token budget ``num_new`` tokens from ``num_computed`` take."""
    rows = num_prompt_logprobs_rows(request, num_computed, num_new)
    return num_new + (PROMPT_LOGPROBS_TOKEN_COST - 1) * rows


def num_tokens_within(request: Request, num_computed: int, budget: int) -> int:
    """The most tokens from ``num_computed`` that cost at most ``budget``."""
    rows = num_prompt_logprobs_rows(request, num_computed, budget)
    if rows * PROMPT_LOGPROBS_TOKEN_COST >= budget:
        return budget // PROMPT_LOGPROBS_TOKEN_COST
    return budget - (PROMPT_LOGPROBS_TOKEN_COST - 1) * rows
