"""The structured-output section: :class:`StructuredOutputsConfig`
(grammars' budgets, the reasoning parser). Imports msgspec and :mod:`asyncstep.errors` only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncstep.config.utils import field_doc
from asyncstep.errors import ConfigError

#: ``reasoning_parser`` names (:class:`asyncstep.engine.chat.reasoning.ReasoningParser`).
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class StructuredOutputsConfig(msgspec.Struct, kw_only=True):
    """Grammars of structured outputs: the budget each is checked against at
    the door, before anything builds or compiles it, and the bounds of their
    compiles in the engine core.

    The budget (``grammar_max_*``) is a first, cheap filter (an over-budget
    grammar is refused with a one-line error naming the option): xgrammar's
    compile time grows faster than linearly with a grammar's literal bytes,
    alternatives, properties and nesting. It cannot see every costly grammar
    (a short bounded repetition can compile for seconds), so each compile
    runs first in a worker process that is killed past
    ``grammar_compile_timeout_s`` or ``grammar_compile_memory_mib``, and when
    every request waiting for it went away. The defaults pass real-world
    grammars (tool-call and form schemas of hundreds of properties, nesting
    to 32 levels) and refuse the sizes of the attacks in
    ``benchmarks/studies/grammar/README.md``.
    """

    grammar_max_bytes: Annotated[
        int,
        field_doc(
            "most bytes of a regex or EBNF grammar, of a choice list, and of the literals "
            "of a JSON schema (property names, enum and const values, patterns)"
        ),
    ] = 64 << 10
    grammar_max_alternatives: Annotated[
        int,
        field_doc(
            "most alternatives of a grammar: '|' in a regex or EBNF grammar (a JSON "
            "schema's patterns included), strings of a choice, enum values of a JSON schema"
        ),
    ] = 4096
    grammar_max_properties: Annotated[
        int,
        field_doc(
            "most properties of a JSON schema, with its other subschemas "
            "(items, anyOf/oneOf/allOf branches, $defs, ...)"
        ),
    ] = 2048
    grammar_max_depth: Annotated[
        int,
        field_doc(
            "deepest nesting of a grammar: subschemas of a JSON schema (its JSON at most "
            "4 times as deep), parentheses of a regex or EBNF grammar"
        ),
    ] = 32
    grammar_compile_workers: Annotated[
        int,
        field_doc(
            "worker processes compiling grammars (started with the first structured "
            "request; each compile waits its turn, round robin over the clients)"
        ),
    ] = 1
    grammar_compile_idle_s: Annotated[
        float,
        field_doc(
            "seconds a compile worker may wait for a compile: then it exits and frees its "
            "memory (xgrammar and the vocabulary); the next grammar not in the cache starts "
            "one again"
        ),
    ] = 60.0
    grammar_compile_timeout_s: Annotated[
        float,
        field_doc(
            "most CPU seconds one grammar's compile may take (and 10 times that of waiting): "
            "past it the compile is killed, its requests refused"
        ),
    ] = 10.0
    grammar_compile_memory_mib: Annotated[
        int,
        field_doc(
            "most memory (MiB) one grammar's compile may add to its worker: past it the "
            "compile is killed, its requests refused"
        ),
    ] = 256
    grammar_cache_mib: Annotated[
        int, field_doc("compiled grammars kept for reuse (MiB, as xgrammar counts their memory)")
    ] = 64
    reasoning_parser: Annotated[
        str | None,
        field_doc(
            "the model thinks first (<think>...</think>): a chat's thinking goes to "
            "reasoning_content, apart from its content, and a grammar (structured outputs, "
            "forced tool calls) applies from the end of the thinking on: qwen3 or deepseek_r1 "
            "(none: no thinking apart)"
        ),
    ] = None

    def __post_init__(self) -> None:
        for name in (
            "grammar_max_bytes",
            "grammar_max_alternatives",
            "grammar_max_properties",
            "grammar_max_depth",
            "grammar_compile_workers",
            "grammar_compile_memory_mib",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("grammar_compile_timeout_s", "grammar_compile_idle_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.grammar_cache_mib < 0:
            raise ConfigError(
                f"grammar_cache_mib must be 0 (no cache) or positive, got {self.grammar_cache_mib}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
