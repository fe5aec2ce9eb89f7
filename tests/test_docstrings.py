"""Docstrings state contracts (what, inputs, outputs, errors, invariants) and
the design reasons in words; measurements go stale with the next change, so
they live with their commands in ``docs/performance.md`` and the studies'
READMEs (``benchmarks/studies/*/README.md``). This walks every docstring of the package
(module, class, function) and fails on a figure that reads as a measurement."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "asyncstep"

#: What reads as a measurement: a duration, a rate, a speed-up, the word
#: itself, the machine it was taken on.
MEASUREMENT = re.compile(
    r"\d(?:[\d.,]*\d)?\s*(?:ms|us|µs|ns)\b"  # 0.1 ms, 35–60 µs
    r"|\d(?:[\d.,–-]*\d)?\s+s\b(?!\s*\+)"  # 0.3-0.6 s (not ``4 s + t``)
    r"|\d(?:\.\d+)?\s*%"  # 86%, 5.6 %
    r"|\btok/s\b|\b[GT]i?B/s\b"  # throughput, bandwidth
    r"|\d(?:\.\d+)?\s*x\s+(?:faster|slower)\b"  # 5x faster
    r"|\d[\d.]*k?\s*->\s*\d[\d.]*k?\s+(?:ms|tok|output)"  # 27.9k -> 35.4k output tok/s
    r"|(?P<word>\b[Mm]easured\b)"
    r"|\b(?:H100|H200|A100)s?\b"
)

#: Where "measured" names what the code measures, not a figure it quotes.
MEASURING = ("asyncstep/bench/",)

#: Figures that are contracts or constants, not measurements: (module, text).
ALLOWED: set[tuple[str, str]] = {
    # a bound the engine keeps: how stale a shared front end's figures may be
    ("asyncstep/engine/front_end/api.py", "at most 50 ms old"),
    # Python's own default switch interval
    ("asyncstep/device/host_stream.py", "5 ms default"),
    # float32's resolution, computed: a property of the format
    ("asyncstep/device/stream.py", "~1 µs at 16 s"),
    ("asyncstep/device/stream.py", "~0.25 ms after an"),
    # the kernel's clock tick (USER_HZ = 100)
    ("asyncstep/logging/spans.py", "tick, ~10 ms"),
    # the KV cache a latency run sizes: a margin, not a result
    ("asyncstep/bench/latency.py", "10 % headroom"),
    # the door measurement's server settings and quiet first row: settings
    ("asyncstep/bench/door.py", "8 MiB bodies, a 30 s body read timeout, 5 s keep-alive"),
    ("asyncstep/bench/door.py", "no attack for 15 s"),
    # the host measurement's unit: what it reports, not a figure
    ("asyncstep/bench/host_cpu.py", "median: tok/s and busy"),
    ("asyncstep/bench/host_cpu.py", "the tok/s figures come from"),
    ("asyncstep/bench/host_cpu.py", "tok/s = num_requests"),
    ("asyncstep/bench/host_peers.py", "tok/s of the median"),
}


def docstrings() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    found.append((name, node.body[0].lineno, " ".join(doc.split())))
    return found


def allowed(name: str, doc: str, match: re.Match[str]) -> bool:
    """The match lies inside an allowed text of its module."""
    if match.group("word") and name.startswith(MEASURING):
        return True
    for where, text in ALLOWED:
        at = doc.find(text)
        if name == where and at >= 0 and at <= match.start() < at + len(text):
            return True
    return False


def test_no_docstring_quotes_a_measurement() -> None:
    hits = [
        f"{name}:{line}: ...{doc[max(0, m.start() - 40) : m.end() + 20]}..."
        for name, line, doc in docstrings()
        for m in MEASUREMENT.finditer(doc)
        if not allowed(name, doc, m)
    ]
    assert hits == [], "\n".join(hits)


def test_the_allowlist_is_still_needed() -> None:
    """Each allowed figure is still where it was: an entry whose text went
    away is removed, so the list stays small and exact."""
    texts = {(name, doc) for name, _, doc in docstrings()}
    for where, text in ALLOWED:
        assert any(name == where and text in doc for name, doc in texts), (where, text)


def test_the_pattern_finds_the_figures_it_is_for() -> None:
    for measured in (
        "Measured on an H200: two collections held the loop 107 and 124 ms",
        "on the CPU about 5x faster than advanced indexing",
        "waking Trio costs 35–60 µs",
        "27.9k -> 35.4k output tok/s inline",
        "a copy costs ~10 µs of host time",
        "2.7 TB/s of KV",
        "importing it takes 0.6 s",
        "showed NaN in 86% of a 64 MiB send",
    ):
        assert MEASUREMENT.search(measured), measured
    for contract in (
        "bits 0..7",
        "transformers 4.x",
        "two float16s",
        "feature ``32 b + 4 s + t``",
        "at most 128 choices",
    ):
        assert not MEASUREMENT.search(contract), contract


#: A module docstring states a contract; the design's story is told once, in
#: docs/architecture.md. Longer than this, it is telling the story.
MAX_MODULE_DOCSTRING_LINES = 50


def test_module_docstrings_are_contracts_not_stories() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): doc.count("\n") + 1
        for path in PACKAGE.rglob("*.py")
        if (doc := ast.get_docstring(ast.parse(path.read_text()), clean=False))
        and doc.count("\n") + 1 > MAX_MODULE_DOCSTRING_LINES
    }
    assert not long, f"move the narrative to docs/architecture.md: {long}"
