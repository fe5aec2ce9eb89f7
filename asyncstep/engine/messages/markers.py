"""Markers in streamed text (``<tool_call>``, ``</think>``): the thinking's
(:data:`START`, :data:`END`), which the front end's reasoning parsers and the
core's reasoning gate both read, and how much of the text seen so far may be
the start of one, and so is held back until the next piece of the stream
tells. Standard library only."""

from __future__ import annotations

#: The thinking's markers (Qwen3's, DeepSeek-R1's).
START, END = "<think>", "</think>"


def held_back(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix
    of ``marker`` (0: none: all of ``text`` may be shown)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
