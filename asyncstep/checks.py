"""Checks of values from outside (a request, a client, a file): each turns
a value into its normalized form or raises
:class:`~asyncstep.errors.InvalidRequestError` with a one-line message naming
the field. Imports nothing but ``asyncstep.errors`` (and numpy, when a
JSON text's depth must be counted)."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

from asyncstep.errors import InvalidRequestError

#: Deepest nesting of objects and arrays taken in a JSON text from outside (a
#: request body, a schema): far below what a recursive parser or encoder
#: survives, far above any real request.
MAX_JSON_DEPTH = 128
#: Every byte but the quote and the brackets (dropped before the depth is measured).
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[]{}')
#: Brackets and quotes measured at a time (the memory of a measure is a few times this).
_DEPTH_SLICE = 1 << 20


def shown(value: object, limit: int = 60) -> str:
    """A value in an error message: its repr, on one line and cut short."""
    try:
        text = repr(value).replace("\n", " ")
    except Exception:  # a caller's object whose repr fails
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def invalid(name: str, expected: str, value: object) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {expected}, got {shown(value)}")


def as_int(name: str, value: object, expected: str) -> int:
    """``value`` as a plain int: ints and numpy integers, not bools."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise invalid(name, expected, value)
    return int(value)


def as_float(name: str, value: object, expected: str) -> float:
    """``value`` as a plain float: ints, floats and numpy reals, not bools."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid(name, expected, value)
    try:
        return float(value)
    except OverflowError:  # an int too large for a float
        raise invalid(name, expected, value) from None


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, "True or False", value)
    return value


def sequence(name: str, value: object, expected: str) -> tuple[object, ...]:
    """A list or tuple (or another sequence) as a tuple; None is empty."""
    if type(value) is tuple:  # the fast paths first: this runs per request
        return value
    if type(value) is list:
        return tuple(value)
    if value is None:
        return ()
    if isinstance(value, str | bytes | bytearray) or not isinstance(value, Sequence):
        raise invalid(name, expected, value)
    return value if isinstance(value, tuple) else tuple(value)


def strings(name: str, value: object, blank: Callable[[str], bool], what: str) -> tuple[str, ...]:
    """A string or a list of strings in UTF-8, as a tuple; none ``blank``."""
    expected = "a string or a list of strings"
    items = (value,) if isinstance(value, str) else sequence(name, value, expected)
    for item in items:
        if not isinstance(item, str):
            raise InvalidRequestError(f"{name} must hold strings only, got {shown(item)}")
        if blank(item):
            raise InvalidRequestError(f"{what} must not be empty")
        if not is_utf8(item):
            raise InvalidRequestError(f"{name} string {shown(item)} is not valid UTF-8")
    return items  # type: ignore[return-value]  # checked above


def is_utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def utf8_size(text: str) -> int:
    """The length of ``text`` in UTF-8 bytes (a lone surrogate counts 3)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_json_depth(name: str, text: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a JSON text whose objects and arrays nest more than ``limit``
    deep, before a recursive parser sees it (no Python loop over its
    bytes: a text with at most ``limit`` opening brackets is taken as it is)."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return
    if json_depth(text, stop_above=limit) > limit:
        raise InvalidRequestError(f"{name} nests more than {limit} levels deep")


def json_depth(text: bytes, stop_above: int | None = None) -> int:
    """How deep the objects and arrays of a JSON text nest (brackets in
    strings do not count), or, with ``stop_above``, the first depth past it
    met (the rest is not read); for a text that is not JSON, a number that
    means nothing (its parser refuses it anyway). Vectorized (numpy), a
    slice of the text at a time."""
    import numpy as np

    if b"\\" in text:  # escapes open and close nothing: drop them
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = text.translate(None, _NOT_MARKS)
    steps = np.zeros(256, dtype=np.int8)
    steps[list(b"[{")], steps[list(b"]}")] = 1, -1
    deepest, depth, in_string = 0, 0, False
    for start in range(0, len(marks), _DEPTH_SLICE):
        part = np.frombuffer(marks[start : start + _DEPTH_SLICE], dtype=np.uint8)
        moves = steps[part]
        # In a string: an odd number of quotes came before (the count wraps
        # at 256: its parity holds).
        strings = np.cumsum(part == ord('"'), dtype=np.uint8) & 1
        if in_string:
            strings ^= 1
        moves[strings.view(np.bool_)] = 0
        levels = np.cumsum(moves, dtype=np.int32)
        deepest = max(deepest, depth + int(levels.max()))
        if stop_above is not None and deepest > stop_above:
            break
        depth += int(levels[-1])
        in_string = bool(strings[-1])
    return deepest
