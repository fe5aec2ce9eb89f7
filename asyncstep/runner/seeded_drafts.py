"""A seeded request's drafts verified with plain decoding's own draws.

Plain decoding samples a seeded request's token at each position with one
vocab-sized exponential draw from the request's generator
(:func:`~asyncstep.runner.sampler.random_sample`: ``argmax(p / q)``). The
rejection sampler draws otherwise (a uniform per draft, the bonus first),
so with speculation a seeded request gets other samples than without it.

:func:`seeded_tokens` replays plain decoding's draws over a speculative
step's positions instead: from the generator's state before the step
(:func:`generator_states`), it samples the target's token at each draft
position in order, keeps the draft while it equals that token, and stops at
the first that differs (that token is the output there) or after the bonus
position. Each output token is then plain decoding's, draw for draw, and
the generator ends where plain decoding leaves it (one draw per token).
Every token is drawn from the target's ``p``, so the output distribution is
the target's; a one-hot draft ``x`` (n-gram or a greedy draft model) is
kept with probability ``p(x)``, the rejection sampler's rate.

For seeded random rows of a step without logits processing (penalties,
bias, bad words, ``min_tokens``: those rows keep the rejection sampler,
whose draft positions see no processing either). Runs on the host, a row
at a time (a device syncs on the drafts). May import torch and the
runner's ``sampler``.
"""

from __future__ import annotations

import torch

__all__ = ["generator_states", "seeded_tokens"]


def generator_states(
    generators: dict[int, torch.Generator], num_draft_tokens: list[int]
) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
    """Each seeded sampling row with drafts: its generator and the state it
    has before the step's sampling draws from it."""
    return {
        i: (generator, generator.get_state())
        for i, generator in generators.items()
        if num_draft_tokens[i] > 0
    }


def seeded_tokens(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """A row's output tokens: ``probs`` ``[len(drafts) + 1, vocab]`` float32,
    the target's distribution at each draft position and the bonus one;
    ``generator`` at its state before the step (see the module doc)."""
    tiny = torch.finfo(probs.dtype).tiny
    tokens: list[int] = []
    for j in range(len(drafts) + 1):
        q = torch.empty_like(probs[j]).exponential_(generator=generator).clamp_min_(tiny)
        token = int(probs[j].div(q).argmax())
        tokens.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens
