"""What the grammar compile workers cost in memory (issue 37, item 3):
``asyncstep serve`` on the embedded model, its processes' resident (RSS),
proportional (PSS) and unique (USS) memory, read from
``/proc/PID/smaps_rollup``, at each stage:

* ``started``: no grammar yet (no worker; xgrammar not imported);
* ``one forced call``: a ``tool_choice: required`` chat (the API server
  checks its grammar at the door, the engine core compiles it in a worker,
  then builds its own);
* ``concurrent``: ``--calls`` forced calls at once, each of a tool of its
  own (a new grammar each): at most ``--grammar-compile-workers`` workers;
* ``idle``: once every worker waited ``--grammar-compile-idle-s`` for a
  compile and stopped.

    python3 benchmarks/studies/grammar/grammar_memory.py \\
        --out benchmarks/results/grammar/memory.json

The machine's load average is recorded (a shared machine: the memory is
what counts here, not the seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

ROLES = {
    "asyncstep.engine.structured_output.grammar_worker": "grammar worker",
    "asyncstep.engine.transport.core_process": "engine core",
    "serve": "API server",
}


def tree(root: int) -> list[int]:
    """``root`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def memory(pid: int) -> dict[str, Any] | None:
    """A process's role and its RSS, PSS and USS (MiB); None once gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        with open(f"/proc/{pid}/smaps_rollup") as f:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
    except (OSError, ValueError):
        return None
    role = next((r for key, r in ROLES.items() if key in argv), " ".join(argv[1:3]))
    uss = kib["Private_Clean"] + kib["Private_Dirty"]
    return {
        "pid": pid,
        "role": role,
        **{
            k: round(v / 1024, 1)
            for k, v in {"rss_mib": kib["Rss"], "pss_mib": kib["Pss"], "uss_mib": uss}.items()
        },
    }


def snapshot(root: int, stage: str) -> dict[str, Any]:
    processes = [m for pid in tree(root) if (m := memory(pid)) is not None]
    total = {k: round(sum(p[k] for p in processes), 1) for k in ("rss_mib", "pss_mib", "uss_mib")}
    print(stage, json.dumps(total), *(f"\n  {json.dumps(p)}" for p in processes), flush=True)
    return {"stage": stage, "processes": processes, "total": total}


def forced_call(i: int) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}, f"detail_{i}": {"type": "string"}},
        "required": ["city"],
    }
    tool = {"type": "function", "function": {"name": f"weather_{i}", "parameters": parameters}}
    return {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": 64,
        "temperature": 0,
    }


async def calls(url: str, first: int, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        replies = await asyncio.gather(
            *(
                client.post("/v1/chat/completions", json=forced_call(first + i))
                for i in range(count)
            )
        )
    for reply in replies:
        assert reply.status_code == 200, reply.text


def serving_url(proc: subprocess.Popen[str]) -> str:
    """The URL the server prints once it listens; its later output is read
    (and dropped) by a thread, so that it never blocks on a full pipe."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("asyncstep: serving "):
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return line.split(" on ")[1].strip()
    raise RuntimeError(f"asyncstep serve exited ({proc.wait()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grammar-compile-workers", type=int, default=1)
    ap.add_argument("--grammar-compile-idle-s", type=float, default=10.0)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    argv = [sys.executable, "-m", "asyncstep", "serve", "--port", "0"]
    argv += ["--grammar-compile-workers", str(args.grammar_compile_workers)]
    argv += ["--grammar-compile-idle-s", str(args.grammar_compile_idle_s)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stages = []
    try:
        url = serving_url(proc)
        stages.append(snapshot(proc.pid, "started"))
        asyncio.run(calls(url, 0, 1))
        stages.append(snapshot(proc.pid, "one forced call"))
        asyncio.run(calls(url, 1, args.calls))
        stages.append(snapshot(proc.pid, "concurrent"))
        deadline = time.monotonic() + args.grammar_compile_idle_s + 60
        while any(m and m["role"] == "grammar worker" for m in map(memory, tree(proc.pid))):
            assert time.monotonic() < deadline, "a worker did not stop"
            time.sleep(0.5)  # another process: nothing to wait on but time
        stages.append(snapshot(proc.pid, "idle"))
    finally:
        proc.terminate()
        proc.wait(60)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            command = "python3 benchmarks/studies/grammar/grammar_memory.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"
            )
            json.dump(
                {"command": command, "load_average": os.getloadavg(), "stages": stages}, f, indent=1
            )


if __name__ == "__main__":
    main()
