"""What else ran on the machine during a host benchmark: the CPU seconds
of the whole machine and of this process's tree (the engine-core process and
the ranks included), read from ``/proc``, and the difference as other
processes' mean busy cores (:func:`other_load`), which skew every figure of
:mod:`~asyncstep.bench.host_cpu`.

Imports the standard library only.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["cpu_seconds", "descendants_cpu_s", "other_load"]


def cpu_seconds() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, of this process and its
    children: the waited-for and the running, the engine-core process and
    the ranks) so far; None without ``/proc/stat``."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    mine = os.times()
    ours = mine.user + mine.system + mine.children_user + mine.children_system
    ticks = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / ticks, ours + descendants_cpu_s()


def descendants_cpu_s() -> float:
    """CPU seconds of this process's running descendants (their own, and
    their waited-for children's), from ``/proc``."""
    parents: dict[int, int] = {}
    seconds: dict[int, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        seconds[pid] = sum(int(f) for f in fields[11:15]) / ticks  # utime stime cutime cstime
    mine, total, frontier = os.getpid(), 0.0, [os.getpid()]
    children: dict[int, list[int]] = defaultdict(list)
    for pid, parent in parents.items():
        children[parent].append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child != mine:
                total += seconds[child]
                frontier.append(child)
    return total


def other_load(start: tuple[float, float] | None, wall_s: float) -> dict[str, Any]:
    """What else ran on the machine during the benchmark: other processes' CPU
    seconds, and as a mean number of busy cores (load average alongside)."""
    end = cpu_seconds()
    if start is None or end is None:
        return {"load_average": list(os.getloadavg())}
    other = max((end[0] - start[0]) - (end[1] - start[1]), 0.0)
    return {
        "other_cpu_s": other,
        "other_cores": other / wall_s,
        "load_average": list(os.getloadavg()),
    }
