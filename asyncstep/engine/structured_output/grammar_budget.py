"""The door's budget of a structured-output grammar: cheap checks of its size
and shape, before anything builds or compiles it.

xgrammar's compile time grows faster than linearly with a grammar's literal
bytes, its alternatives, a schema's properties and its nesting, so each is
bounded (the ``grammar_max_*`` fields of
:class:`~asyncstep.config.StructuredOutputsConfig`); a grammar over one is
refused with a one-line :class:`InvalidRequestError` that names the limit
and its option. The checks read the text, and the schema's JSON once,
without recursion (a hostile schema may nest deeper than Python's stack),
and need no vocabulary: they run in the front end.

The budget is a first filter, not the bound: a short grammar can still be
costly (a bounded repetition of a broad character class), so the engine core
compiles each grammar under a time and a memory limit
(:mod:`asyncstep.engine.structured_output.grammar_pool`). Imports the params, the config and
the errors only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncstep.config import StructuredOutputsConfig
from asyncstep.errors import InvalidRequestError
from asyncstep.structured_params import StructuredOutputsParams

#: Schema keywords whose value is a subschema (or a boolean).
_SUBSCHEMA = frozenset(
    {
        "items",
        "additionalItems",
        "additionalProperties",
        "unevaluatedItems",
        "unevaluatedProperties",
        "contains",
        "propertyNames",
        "not",
        "if",
        "then",
        "else",
    }
)
#: Schema keywords whose value is a list of subschemas.
_SUBSCHEMA_LIST = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
#: Schema keywords whose value maps names to subschemas.
_SUBSCHEMA_MAP = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


@dataclass
class GrammarSize:
    """What the budget counts of one grammar."""

    #: Bytes of its text (regex, EBNF) or of its literals (choices; a
    #: schema's property names, enum and const values, patterns).
    num_bytes: int = 0
    #: ``|`` of a regex or EBNF grammar, strings of a choice, enum values.
    num_alternatives: int = 0
    #: Properties and other subschemas of a JSON schema.
    num_properties: int = 0
    #: Nesting of subschemas, or of parentheses.
    depth: int = 0


def check_grammar_budget(params: StructuredOutputsParams, budget: StructuredOutputsConfig) -> None:
    """Raise :class:`InvalidRequestError` (one line) when ``params``' grammar
    is over ``budget``. ``params`` must be validated (its kind's value has
    the kind's type; a schema is the JSON text of an object)."""
    kind = params.kind
    name = f"structured_outputs.{kind}"
    if kind == "json":
        schema_size(name, params.spec, budget)
    elif kind == "choice":
        choices = params.choice or ()
        size = GrammarSize(sum(len(c.encode()) for c in choices), len(choices))
        check_size(name, size, budget)
    elif kind != "json_object":
        text = params.spec
        check_size(name, GrammarSize(num_bytes=len(text.encode())), budget, text=True)
        check_size(name, pattern_size(text, ebnf=kind == "grammar"), budget, text=True)


def check_size(
    name: str, size: GrammarSize, budget: StructuredOutputsConfig, *, text: bool = False
) -> None:
    """Raise :class:`InvalidRequestError` naming the first count of ``size``
    over ``budget`` (``text``: its bytes are a regex's or a grammar's text)."""
    checks = (
        (size.num_bytes, "is {} bytes long" if text else "has {} bytes of literals", "bytes"),
        (size.num_alternatives, "has {} alternatives", "alternatives"),
        (size.num_properties, "has {} properties and subschemas", "properties"),
        (size.depth, "nests {} levels deep", "depth"),
    )
    for value, what, limit in checks:
        option = f"grammar_max_{limit}"
        if value > getattr(budget, option):
            raise InvalidRequestError(
                f"{name} {what.format(value)}; the limit is {getattr(budget, option)} ({option})"
            )


def pattern_size(text: str, *, ebnf: bool) -> GrammarSize:
    """The alternatives (``|``) and the parenthesis nesting of a regex, or
    of an EBNF grammar (``ebnf``: its string literals skipped too);
    character classes and escaped characters are skipped. Its bytes are
    those of ``text``."""
    alternatives = depth = deepest = 0
    in_class = False
    quote = ""
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif ebnf and char in "\"'":
            quote = char
        elif char == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif char == ")":
            depth = max(depth - 1, 0)
        elif char == "|":
            alternatives += 1
    return GrammarSize(len(text.encode()), alternatives, 0, deepest)


def schema_size(name: str, text: str, budget: StructuredOutputsConfig) -> GrammarSize:
    """What the budget counts of a JSON schema (its JSON text, an object),
    checked against ``budget`` as it is counted (:class:`InvalidRequestError`
    at the first count over it). Its JSON nesting was bounded already
    (``StructuredOutputsParams`` checks :data:`~asyncstep.checks.MAX_JSON_DEPTH`)."""
    document = json.loads(text)
    size = GrammarSize()
    for schema, depth in _subschemas(document):
        size.num_properties += depth > 0
        size.depth = max(size.depth, depth)
        _count_literals(schema, size)
        check_size(name, size, budget)  # as it grows: a huge schema stops early
    return size


def _subschemas(root: Any) -> Iterator[tuple[dict[str, Any], int]]:
    """Every schema object in ``root`` (a schema), with its nesting (the
    root: 0). Booleans (schemas too) are not listed."""
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        schema, depth = stack.pop()
        if not isinstance(schema, dict):
            continue
        yield schema, depth
        for key, value in schema.items():
            if key in _SUBSCHEMA_MAP and isinstance(value, dict):
                stack.extend((child, depth + 1) for child in value.values())
            elif key in _SUBSCHEMA_LIST and isinstance(value, list):
                stack.extend((child, depth + 1) for child in value)
            elif key in _SUBSCHEMA:
                stack.append((value, depth + 1))


def _count_literals(schema: dict[str, Any], size: GrammarSize) -> None:
    """Add a schema object's own literals to ``size``: its property names,
    enum and const values, patterns (its ``pattern`` and the names of its
    ``patternProperties``: their alternatives and nesting too)."""
    properties = schema.get("properties")
    if isinstance(properties, dict):
        size.num_bytes += sum(len(str(name).encode()) for name in properties)
    enum = schema.get("enum")
    if isinstance(enum, list):
        size.num_alternatives += len(enum)
        size.num_bytes += sum(_json_bytes(value) for value in enum)
    if "const" in schema:
        size.num_bytes += _json_bytes(schema["const"])
    patterns = schema.get("patternProperties")
    patterns = list(patterns) if isinstance(patterns, dict) else []
    if isinstance(schema.get("pattern"), str):
        patterns.append(schema["pattern"])
    for pattern in patterns:
        found = pattern_size(str(pattern), ebnf=False)
        size.num_bytes += found.num_bytes
        size.num_alternatives += found.num_alternatives
        size.depth = max(size.depth, found.depth)


def _json_bytes(value: Any) -> int:
    """Bytes of ``value`` as compact JSON (its nesting was checked)."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
