"""``StructuredOutputsParams``: the grammar a request's output must follow
(vLLM's names): exactly one of ``json`` (a JSON schema), ``json_object``,
``regex``, ``choice`` or ``grammar`` (EBNF, xgrammar's dialect).

Checked here for shape (types, sizes, exactly one kind, a schema that parses
as JSON and nests at most :data:`~asyncstep.checks.MAX_JSON_DEPTH` deep,
checked before it is parsed); whether the grammar compiles is checked at the
engine's door (:mod:`asyncstep.engine.structured_output.grammar`). Imports nothing heavy: a field of
:class:`~asyncstep.datatypes.SamplingParams`, it travels on every wire.
"""

from __future__ import annotations

import json as _json
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from msgspec.structs import force_setattr

from asyncstep.checks import check_flag, check_json_depth, invalid, is_utf8, sequence, shown
from asyncstep.errors import InvalidRequestError

#: Longest schema, regex or grammar text, and longest choice list (in characters).
MAX_GRAMMAR_CHARS = 1 << 20
#: Most strings a ``choice`` may list.
MAX_CHOICES = 1024
#: The kinds, in the order a message names them.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: Fields beside the kinds.
OPTIONS = ("disable_any_whitespace",)


class StructuredOutputsParams(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True
):
    """Exactly one of: ``json`` a JSON schema (a dict, or its JSON text;
    kept as compact JSON text), ``json_object=True`` any JSON object,
    ``regex`` a regular expression the whole output matches, ``choice`` a
    list of strings the output is one of, ``grammar`` an EBNF grammar (its
    rule ``root`` is the output). Checked at construction and when decoded
    (:class:`~asyncstep.errors.InvalidRequestError` naming the field)."""

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    #: ``json``: no whitespace at all (compact JSON, ``","`` and ``":"``), as
    #: vLLM's option; else standard JSON indented by 2, no other whitespace.
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check and normalize every field in place (idempotent)."""
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise InvalidRequestError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {what}"
            )
        if self.json_object is not None:
            check_flag("structured_outputs.json_object", self.json_object)
        check_flag("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        checks: dict[str, Callable[[str, object], object]] = {
            "json": _check_schema,
            "regex": _check_text,
            "choice": _check_choice,
            "grammar": _check_text,
        }
        for kind, check in checks.items():
            value = getattr(self, kind)
            if value is not None:
                checked = check(f"structured_outputs.{kind}", value)
                if checked is not value:
                    force_setattr(self, kind, checked)

    @property
    def kind(self) -> str:
        """The one kind given: ``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def grammar_kind(self) -> str:
        """:attr:`kind`, ``json_compact`` for ``json`` without whitespace:
        with :attr:`spec`, what a compiled grammar is known by."""
        compact = self.kind == "json" and self.disable_any_whitespace
        return "json_compact" if compact else self.kind

    @property
    def spec(self) -> str:
        """The kind's text (schema JSON, regex, grammar; choices as a JSON list;
        ``""`` for ``json_object``): with :attr:`kind`, the grammar's cache key."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return _json.dumps(list(value), ensure_ascii=False)
        return "" if self.kind == "json_object" else str(value)


def check_structured_outputs(name: str, value: object) -> StructuredOutputsParams | None:
    """A ``SamplingParams`` field: None, the struct, or a mapping of its fields."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, Mapping):
        raise invalid(name, "None, a StructuredOutputsParams or a dict of its fields", value)
    unknown = sorted(str(key) for key in value if key not in (*KINDS, *OPTIONS))
    if unknown:
        raise InvalidRequestError(f"{name} has unknown field {shown(unknown[0])}")
    return StructuredOutputsParams(**value)


def _check_text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise invalid(name, "a string", value)
    if not value.strip():
        raise InvalidRequestError(f"{name} must not be empty")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{name} is longer than {MAX_GRAMMAR_CHARS} characters")
    if not is_utf8(value):
        raise InvalidRequestError(f"{name} is not valid UTF-8")
    return value


def _check_schema(name: str, value: object) -> str:
    """A JSON schema (an object) as JSON text (a dict as compact JSON)."""
    if isinstance(value, Mapping):
        try:
            text = _json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"{name} is not JSON: {exc}") from None
    else:
        text = _check_text(name, value)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{name} is longer than {MAX_GRAMMAR_CHARS} characters")
    check_json_depth(name, text.encode("utf-8", "surrogatepass"))
    try:
        parsed = _json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"{name} must be a JSON object (a schema), got {shown(parsed)}")
    if isinstance(value, str):
        return value
    return text


def _check_choice(name: str, value: object) -> tuple[str, ...]:
    items = sequence(name, value, "a list of strings")
    if not items:
        raise InvalidRequestError(f"{name} must list at least one string")
    if len(items) > MAX_CHOICES:
        raise InvalidRequestError(f"{name} lists more than {MAX_CHOICES} strings")
    total = 0
    for item in items:
        if not isinstance(item, str):
            raise InvalidRequestError(f"{name} must hold strings only, got {shown(item)}")
        if not item:
            raise InvalidRequestError(f"{name} must not hold an empty string")
        if not is_utf8(item):
            raise InvalidRequestError(f"{name} string {shown(item)} is not valid UTF-8")
        total += len(item)
    if total > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(f"{name} is longer than {MAX_GRAMMAR_CHARS} characters")
    return items  # type: ignore[return-value]  # checked above
