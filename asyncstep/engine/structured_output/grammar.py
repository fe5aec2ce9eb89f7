"""Grammars of structured outputs, through xgrammar: the check at the
engine's door, and the compiler of a model's vocabulary.

The door (:func:`check_grammar`) first checks the grammar against its
budget (:mod:`asyncstep.engine.structured_output.grammar_budget`: sizes, no xgrammar), then
builds it (no vocabulary). The compiler (:class:`GrammarCompiler`) runs in
the engine core and in its compile workers
(:mod:`asyncstep.engine.structured_output.grammar_worker`);
it keeps no cache (the core's is bounded in bytes:
:mod:`asyncstep.engine.structured_output.grammar_cache`).

xgrammar takes seconds to import, so it is imported on first use only (an
engine that never sees a structured request never pays it); callers run
these functions off their event loop. May import xgrammar, msgspec,
``asyncstep.config``, ``asyncstep.structured_params`` / ``asyncstep.errors``
and the budget.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from asyncstep.config import StructuredOutputsConfig
from asyncstep.engine.structured_output.grammar_budget import check_grammar_budget
from asyncstep.errors import InvalidRequestError
from asyncstep.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")

#: How a JSON schema's output is laid out, by grammar kind (xgrammar's
#: ``from_json_schema`` keywords). ``json``: standard JSON, as
#: ``json.dumps(value, indent=2)`` lays it out (xgrammar's default, any
#: whitespace between tokens, lets a model write blank lines and spaces
#: before commas, or fill its budget with them; its ``max_whitespace_cnt``
#: bounds a run's length, not where it goes). ``json_compact``
#: (``disable_any_whitespace``): no whitespace at all, as vLLM's option.
JSON_LAYOUTS: dict[str, dict[str, Any]] = {
    "json": {"any_whitespace": False, "indent": 2},
    "json_compact": {"any_whitespace": False, "separators": (",", ":")},
}


def check_grammar(
    params: StructuredOutputsParams, budget: StructuredOutputsConfig | None = None
) -> None:
    """Raise :class:`InvalidRequestError` (one line) when ``params``' grammar
    is over ``budget`` (checked first, when given) or does not compile (a
    schema xgrammar cannot turn into a grammar, a regex or EBNF with a
    syntax error). Builds the grammar only (no vocabulary)."""
    if budget is not None:
        check_grammar_budget(params, budget)
    grammar_of(params)


def grammar_of(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The xgrammar ``Grammar`` of ``params``; a bad one raises
    :class:`InvalidRequestError` naming the field."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            layout = JSON_LAYOUTS[params.grammar_kind]
            return xgr.Grammar.from_json_schema(params.spec, **layout)
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
    """Compiles grammars over a model's vocabulary (xgrammar's
    ``TokenizerInfo``), without a cache of its own."""

    def __init__(self, tokenizer_info: xgrammar.TokenizerInfo, *, max_threads: int) -> None:
        import xgrammar as xgr

        self.tokenizer_info = tokenizer_info
        self._compiler = xgr.GrammarCompiler(
            tokenizer_info, max_threads=max_threads, cache_enabled=False
        )

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_threads: int,
    ) -> GrammarCompiler:
        """The compiler of ``tokenizer``'s vocabulary, ``vocab_size`` ids wide."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        return cls(info, max_threads=max_threads)

    @classmethod
    def from_vocabulary(cls, serialized: str, *, max_threads: int) -> GrammarCompiler:
        """The compiler of a vocabulary :meth:`serialize_vocabulary` gave."""
        import xgrammar as xgr

        return cls(xgr.TokenizerInfo.deserialize_json(serialized), max_threads=max_threads)

    def serialize_vocabulary(self) -> str:
        """The vocabulary as xgrammar's JSON (what a compile worker needs)."""
        return str(self.tokenizer_info.serialize_json())

    def compile(self, kind: str, spec: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``kind`` and its text
        (``StructuredOutputsParams.spec``); :class:`InvalidRequestError`
        when it does not compile."""
        compiler: Any = self._compiler
        try:
            if kind in JSON_LAYOUTS:
                return compiler.compile_json_schema(spec, **JSON_LAYOUTS[kind])
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
