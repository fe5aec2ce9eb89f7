"""Checks of values from outside (a request, a client, a file): each turns
a value into its normalized form or raises
:class:`~asyncstep.errors.InvalidRequestError` with a one-line message naming
the field. Imports nothing but ``asyncstep.errors``."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

from asyncstep.errors import InvalidRequestError


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
