"""The one results format of ``asyncstep bench``: a :class:`Result` (JSON,
schema :data:`FORMAT`) holding the command line, the git revision, the
machine, the engine config, the mode's options and its figures, one
:class:`Case` per configuration measured; and its table on stdout (rich).

Figures are flat numbers named with their unit (``_ms``, ``_s``,
``_tok_s``, ``_per_s``), None where not measured (a NaN is written as
None); nested material (each run, HF's run, the floor's terms) goes in a
case's ``detail``.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

FORMAT = "asyncstep-bench/1"
#: vLLM's latency percentiles.
PERCENTILES = (10, 25, 50, 75, 90, 99)


class Git(msgspec.Struct, kw_only=True):
    revision: str
    #: Uncommitted changes to tracked files.
    dirty: bool


class Machine(msgspec.Struct, kw_only=True):
    cpu: str
    cpu_count: int
    #: The cores this process may run on.
    cpu_affinity: int
    load_avg: list[float]
    gpu: str | None
    gpu_count: int
    host: str
    platform: str
    python: str
    torch: str | None
    transformers: str | None


class Case(msgspec.Struct, kw_only=True):
    """One configuration measured."""

    name: str
    params: dict[str, Any]
    figures: dict[str, float | None]
    detail: dict[str, Any] = {}


class Result(msgspec.Struct, kw_only=True):
    format: str = FORMAT
    mode: str
    #: The command as asyncstep's (``asyncstep bench MODE ...``).
    command: list[str]
    #: ``sys.argv`` of the process (a script's, when one called the bench).
    invoked: list[str]
    git: Git | None
    started: str
    finished: str
    machine: Machine
    #: The engine config (every option), None where the mode opens no engine.
    engine: dict[str, Any] | None
    #: The mode's own flags.
    options: dict[str, Any]
    cases: list[Case]
    #: Mode-specific material (the copy bandwidth, a start-up timeline, ...).
    extra: dict[str, Any] = {}


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def git_info(where: Path | None = None) -> Git | None:
    """The checkout holding ``where`` (default: this package): its HEAD and
    whether tracked files differ from it; None outside a git checkout."""
    where = where or Path(__file__).resolve().parent
    git = shutil.which("git")
    if git is None:
        return None
    try:
        head = subprocess.run(
            [git, "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            [git, "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Git(revision=head.stdout.strip(), dirty=bool(status.stdout.strip()))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> tuple[str | None, int]:
    """The first GPU's name and the count: torch's where this process has
    imported it, else nvidia-smi's (no torch import for that)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if not torch.cuda.is_available():
            return None, 0
        return str(torch.cuda.get_device_name(0)), int(torch.cuda.device_count())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, 0
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, 0
    names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return (names[0] if names else None), len(names)


def machine_info() -> Machine:
    gpu, gpu_count = _gpus()
    return Machine(
        cpu=_cpu_model(),
        cpu_count=os.cpu_count() or 1,
        cpu_affinity=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        load_avg=list(os.getloadavg()),
        gpu=gpu,
        gpu_count=gpu_count,
        host=platform.node(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=_version("torch"),
        transformers=_version("transformers"),
    )


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (linear between ranks); NaN of nothing."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def finite(value: float | None) -> float | None:
    """``value``, or None for a NaN or an infinity."""
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None where either is missing or not finite, or b is 0."""
    if a is None or b is None or not b or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def _clean(value: Any) -> Any:
    """``value`` as strict JSON takes it: NaNs and infinities as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def encode(result: Result) -> bytes:
    return msgspec.json.format(msgspec.json.encode(_clean(msgspec.to_builtins(result))), indent=1)


def decode(data: bytes) -> Result:
    """A results file, checked against the format (msgspec.ValidationError if not)."""
    result = msgspec.json.decode(data, type=Result)
    if result.format != FORMAT:
        raise msgspec.ValidationError(f"format {result.format!r}, expected {FORMAT!r}")
    return result


def write(result: Result, path: str | Path | None) -> None:
    """Write ``result`` to ``path`` (its folder made), if one is given."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode(result) + b"\n")
    print(f"wrote {path}", file=sys.stderr)


#: A table column: (header, where in a case: "params.X" or "figures.X", format).
Column = tuple[str, str, str]


def _cell(case: Case, path: str, spec: str) -> str:
    where, _, key = path.partition(".")
    value = case.params.get(key) if where == "params" else case.figures.get(key)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if spec and isinstance(value, int | float):
        return format(value, spec)
    return str(value)


def print_table(result: Result, columns: Sequence[Column], title: str) -> None:
    """The cases as a table on stdout (only the columns some case has)."""
    from rich.console import Console
    from rich.table import Table

    shown = [c for c in columns if any(_cell(case, c[1], c[2]) != "-" for case in result.cases)]
    table = Table(title=title)
    for header, _, _ in shown:
        table.add_column(header, justify="right")
    for case in result.cases:
        table.add_row(*(_cell(case, path, spec) for _, path, spec in shown))
    Console(width=max(100, shutil.get_terminal_size((200, 24)).columns)).print(table)


def make_result(
    mode: str,
    argv: Sequence[str],
    started: str,
    *,
    engine: Any,
    options: dict[str, Any],
    cases: list[Case],
    extra: dict[str, Any] | None = None,
    command: Sequence[str] | None = None,
) -> Result:
    """The record of one run (``engine``: its EngineConfig, or None;
    ``command``: the command line before ``argv``, ``asyncstep bench MODE``'s
    by default)."""
    return Result(
        mode=mode,
        command=[*(["asyncstep", "bench"] if command is None else command), *argv],
        invoked=list(sys.argv),
        git=git_info(),
        started=started,
        finished=now(),
        machine=machine_info(),
        engine=None if engine is None else msgspec.to_builtins(engine),
        options=options,
        cases=cases,
        extra=extra or {},
    )
