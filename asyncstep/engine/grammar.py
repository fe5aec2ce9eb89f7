"""Grammars of structured outputs, through xgrammar: the check at the
engine's door, and the compiler the engine core keeps.

xgrammar takes ~3 s to import, so it is imported on first use only (an
engine that never sees a structured request never pays it); callers run
these functions off their event loop. May import xgrammar, numpy, msgspec and
``asyncstep.structured_params`` / ``asyncstep.errors``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from asyncstep.errors import InvalidRequestError
from asyncstep.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

#: Compiled grammars the core keeps (by kind and text), most recently used first.
COMPILED_CACHE_SIZE = 256
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise :class:`InvalidRequestError` (one line) when ``params``' grammar
    does not compile (a schema xgrammar cannot turn into a grammar, a regex
    or EBNF with a syntax error). Builds the grammar only (no vocabulary):
    under a millisecond once xgrammar is imported."""
    grammar_of(params)


def grammar_of(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The xgrammar ``Grammar`` of ``params``; a bad one raises
    :class:`InvalidRequestError` naming the field."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(params.spec)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(params.spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice or ()))
        return xgr.Grammar.from_ebnf(params.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"structured_outputs.{kind} does not compile: {_one_line(exc)}"
        ) from None


def choice_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose outputs are exactly ``choices``."""
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
    return f"root ::= {alternatives}"


def _one_line(exc: BaseException) -> str:
    """xgrammar's message without its ``[time] file:line:`` prefix, on one line."""
    text = _XGRAMMAR_LOCATION.sub("", str(exc).strip())
    return " ".join(text.split())[:300]


class GrammarCompiler:
    """Compiles the grammars of a model's vocabulary, with a cache (the
    same schema in many requests compiles once). The vocabulary's token
    table (xgrammar's ``TokenizerInfo``) is built on first use."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_threads: int = 4,
    ) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.tokenizer_info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
        self.compile = lru_cache(maxsize=COMPILED_CACHE_SIZE)(self._compile)

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    def _compile(self, kind: str, spec: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``kind`` and its text (``StructuredOutputsParams.spec``)."""
        compiler: Any = self._compiler
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec)
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(json.loads(spec)))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(
                f"structured_outputs.{kind} does not compile: {_one_line(exc)}"
            ) from None
