"""The speculative decoding section: vLLM's ``speculative_config``
(:class:`SpeculativeConfig`) in :class:`SpeculativeSection`. Imports msgspec
and :mod:`asyncstep.errors` only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncstep.config.utils import field_doc
from asyncstep.errors import ConfigError

#: Speculative decoding methods (vLLM's names) that asyncstep implements.
SPECULATIVE_METHODS = ("ngram", "draft_model")
#: Most draft tokens per step: a verify step of ``1 + k`` tokens stays within the
#: CPU's packed one-call path (16 tokens) and the rejection sampler's small tensors.
MAX_SPECULATIVE_TOKENS = 15
#: ``prompt_lookup_min`` / ``prompt_lookup_max`` when neither is given (vLLM's).
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding, vLLM's ``speculative_config`` names.

    ``method`` ``"draft_model"``: a smaller checkpoint ``model`` of the same
    vocabulary proposes ``num_speculative_tokens`` tokens greedily after each
    step, on the same rank with a KV cache of its own (one tensor-parallel
    rank; see :mod:`asyncstep.runner.draft_model`); the lookup bounds are
    unused.

    ``method`` ``"ngram"``: prompt lookup (no draft model): the drafts are the
    up to ``num_speculative_tokens`` tokens that followed an earlier
    occurrence of the sequence's last ``n`` tokens, for the longest ``n`` in
    ``[prompt_lookup_min, prompt_lookup_max]`` that occurs (prompt and output
    both searched; see :mod:`asyncstep.engine.spec_decode.ngram_proposer`). One of the
    two lookup bounds given sets the other (vLLM's rule); neither: both
    :data:`DEFAULT_PROMPT_LOOKUP`. ``disable_by_batch_size`` (vLLM's name):
    no drafts in a step while at least this many requests run (a verify
    step grows with the batch; on the CPU past ``packed_max_tokens`` tokens
    it leaves the one-call decoder stack); None: never. A bad value is a
    one-line :class:`ConfigError`; the resolved bounds are stored.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None
    #: ``"draft_model"``: the draft checkpoint (a path; a shape name with
    #: dummy weights), with the target's tokenizer.
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError(
                'speculative_config needs "model" (the draft checkpoint) with method '
                '"draft_model", and only then'
            )
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "speculative_config num_speculative_tokens must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if high is None:
            high = DEFAULT_PROMPT_LOOKUP if low is None else low
        if low is None:
            low = high
        if not 1 <= low <= high:
            raise ConfigError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {low} and {high}"
            )
        self.prompt_lookup_min, self.prompt_lookup_max = low, high
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ConfigError(
                "speculative_config disable_by_batch_size must be >= 1 (or none), "
                f"got {self.disable_by_batch_size}"
            )


class SpeculativeSection(msgspec.Struct, kw_only=True):
    """The speculative decoding section: one option, vLLM's
    ``speculative_config`` (a :class:`SpeculativeConfig`, or a dict of its
    fields; on the command line, JSON). None: no speculation."""

    speculative_config: Annotated[
        SpeculativeConfig | None,
        field_doc(
            'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": k, '
            '"prompt_lookup_min": m, "prompt_lookup_max": M} or {"method": "draft_model", '
            '"model": PATH, "num_speculative_tokens": k}; none: off'
        ),
    ] = None
