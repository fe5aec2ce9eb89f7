"""The HTTP door under full-size attacks (issue 22), each beside a healthy
stream, against one ``asyncstep serve`` of the embedded SmolLM2 on its
defaults (its own context, 8 MiB bodies, a 30 s body read timeout, 5 s
keep-alive):

* ``text 8 MiB``, ``chat 8 MiB``, ``token ids 8 MiB``: a prompt filling the
  body limit (past the byte bound, or the context by count);
* ``text at the bound``: text just under the byte bound that tokenizes
  slowly (about one token a character), then is refused by its token count;
  ``slow prompts``: prompts that fit the context (a newline and 80 spaces is
  one token) but are slow to tokenize, refused afterwards by ``max_tokens``;
* ``json 100k deep``: a body nested 100k deep in each place a request nests
  (and schemas 10k deep; one 900 deep); ``json 8 MiB deep``: 4M levels;
* ``slow bodies``: clients sending their body a byte a second;
* ``keep-alive after generation``: connections that carried a completion,
  then idle (each must be closed after the keep-alive timeout);
  ``close and HTTP/1.0``: ``Connection: close`` and HTTP/1.0 requests, whole,
  streamed and refused in the response;
* ``redirect``: ``GET /v1/models/`` with ``Host: evil.example``.

Reported per attack: the statuses it got, whether connections closed, its
time, the healthy stream's largest gap between chunks, the server's peak RSS
growth (its processes' ``VmHWM``, reset before each attack), and the load
average (the machine may be shared: read the numbers as upper bounds when
it is busy; the first row, no attack for 15 s, is the stream's gap alone).
The harness is :mod:`asyncstep.bench.door_harness` (``tests/server/test_door.py``
runs the same attacks scaled down). ``--out``: ``asyncstep bench``'s results
format, a case per attack.

    python3 -m asyncstep.bench.door --out FILE

Arguments after ``--`` go to ``asyncstep serve``; ``--server-checkout DIR``
serves another checkout's code (a before/after comparison: the byte bound is
then still this checkout's, for the attack at the bound).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from asyncstep.bench import door_harness as door
from asyncstep.bench.measurement import record, row_case
from asyncstep.bench.results import now, write

BODY_LIMIT = 8 << 20
#: Prompts of the ``slow prompts`` attack.
SLOW_PROMPTS = 8
#: The deepest nesting a body under the limit holds.
DEEPEST = BODY_LIMIT // 2 - 1
#: Completions for the connection attacks.
WHOLE = {"prompt": "Hi", "max_tokens": 2}
STREAMED = WHOLE | {"stream": True}
REFUSED_IN_RESPONSE = STREAMED | {"structured_outputs": {"regex": "("}}


def fill(key: str, make: Callable[[int], Any], shell: dict[str, Any]) -> bytes:
    """``shell`` with ``key`` = ``make(n)``, ``n`` as large as the body limit allows."""
    n = BODY_LIMIT - len(json.dumps(shell)) - 200
    while len(body := json.dumps(shell | {key: make(n)}).encode()) > BODY_LIMIT:
        n -= len(body) - BODY_LIMIT + 16
    return body


def prompt_attacks() -> dict[str, tuple[str, bytes]]:
    text = fill("prompt", lambda n: "x" * n, {})
    chat = fill("messages", lambda n: [{"role": "user", "content": "x" * (n - 40)}], {})
    ids = fill("prompt", lambda n: [1] * (n // 3), {})
    return {
        "text 8 MiB": ("/v1/completions", text),
        "chat 8 MiB": ("/v1/chat/completions", chat),
        "token ids 8 MiB": ("/v1/completions", ids),
    }


def slow_prompts(model: dict[str, Any]) -> bytes:
    """Prompts of 6000 tokens each, refused (after their tokenization) by a
    ``max_tokens`` past what the context leaves."""
    prompt = ("\n" + " " * 80) * 6000
    body = {"prompt": [prompt] * SLOW_PROMPTS, "max_tokens": model["max_model_len"]}
    return json.dumps(body).encode()


def posts(server: door.Server, bodies: dict[str, tuple[str, bytes]]) -> Callable[[], Any]:
    def attack() -> dict[str, Any]:
        out = {}
        for name, (path, body) in bodies.items():
            began = time.monotonic()
            try:
                r = door.post_json(server.url, path, body)
            except httpx.TimeoutException:
                out[name] = {"status": "no answer in 120 s", "bytes": len(body)}
                continue
            message = r.json().get("error", {}).get("message", "") if r.status_code >= 400 else ""
            out[name] = {
                "status": r.status_code,
                "bytes": len(body),
                "s": round(time.monotonic() - began, 2),
                "message": message[:160],
            }
        return out

    return attack


def connections(
    server: door.Server, cases: Sequence[tuple[str, dict[str, Any], str, list[str]]]
) -> Callable[[], Any]:
    """Each case (name, body, HTTP version, headers) on a connection of its
    own, all at once: its status, whether it was closed, and when."""

    def one(i: int) -> dict[str, Any]:
        name, body, version, headers = cases[i]
        began = time.monotonic()
        raw = json.dumps(body).encode()
        sock = door.send_request(server.port, "POST", "/v1/completions", raw, headers, version)
        response, closed = door.read_until_closed(sock, timeout_s=20)
        return {
            "case": name,
            "status": door.status_of(response),
            "closed": closed,
            "open_s": round(time.monotonic() - began, 2),
        }

    return lambda: door.run_threads(len(cases), one)


def slow_bodies(server: door.Server, clients: int, give_up_s: float) -> Callable[[], Any]:
    def one(i: int) -> dict[str, Any]:
        began = time.monotonic()
        response, closed = door.slow_body(server.port, 1000, every_s=1.0, give_up_s=give_up_s)
        return {
            "status": door.status_of(response),
            "closed": closed,
            "after_s": round(time.monotonic() - began, 1),
        }

    return lambda: door.run_threads(clients, one)


def redirect(server: door.Server) -> Callable[[], Any]:
    def attack() -> dict[str, Any]:
        headers = ["host: evil.example", "connection: close"]
        sock = door.send_request(server.port, "GET", "/v1/models/", headers=headers)
        response, _ = door.read_until_closed(sock, timeout_s=8)
        head = response.split(b"\r\n\r\n", 1)[0].decode(errors="replace")
        location = [h for h in head.split("\r\n") if h.lower().startswith("location:")]
        return {"status": door.status_of(response), "location": location[0] if location else None}

    return attack


def summary(result: Any) -> str:
    """A short account of an attack's result."""
    if result is None:
        return "-"
    rows = result if isinstance(result, list) else list(result.values())
    if isinstance(result, dict) and "status" in result:
        rows = [result]
    statuses = Counter(str(r.get("status")) for r in rows)
    text = ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items()))
    if any("closed" in r for r in rows):
        text += f"; closed {sum(bool(r['closed']) for r in rows)}/{len(rows)}"
    return text


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from asyncstep.engine.front_end.input_processor import prompt_byte_limit
    from asyncstep.models.loader import open_checkpoint

    rows: list[dict[str, Any]] = []
    checkout = None if args.server_checkout is None else str(args.server_checkout)
    with door.serving(args.serve_args, checkout=checkout) as server:
        model = httpx.get(server.url + "/v1/models").json()["data"][0]
        bound = prompt_byte_limit(open_checkpoint(None).load_tokenizer(), model["max_model_len"])
        print(f"max_model_len {model['max_model_len']}, prompt byte bound {bound}")
        print(f"load average {door.load_average()}")
        alone = door.HealthyStream(server.url, stop_at=40).start()
        alone.finish(more_chunks=0)
        print(f"healthy stream alone: largest gap {alone.max_gap_s:.3f} s over 40 chunks")
        reference = alone.text
        versions = {"close": ("HTTP/1.1", ["connection: close"]), "HTTP/1.0": ("HTTP/1.0", [])}
        kinds = {"whole": WHOLE, "stream": STREAMED, "refused": REFUSED_IN_RESPONSE}
        near = door.slow_text(bound - 1000)
        attacks: list[tuple[str, int, Callable[[], Any]]] = [
            ("nothing, 15 s (the noise floor)", 0, lambda: time.sleep(15)),
            ("text 8 MiB, chat 8 MiB, token ids 8 MiB", 3, posts(server, prompt_attacks())),
            (
                "text at the bound",
                1,
                posts(server, {"text": ("/v1/completions", json.dumps({"prompt": near}).encode())}),
            ),
            (
                f"slow prompts ({SLOW_PROMPTS} x 486 kB)",
                1,
                posts(server, {"slow prompts": ("/v1/completions", slow_prompts(model))}),
            ),
            (
                "json 100k deep (12 places)",
                12,
                posts(server, door.deep_bodies(100_000, schema_depth=10_000)),
            ),
            (
                "json 8 MiB deep (4M levels)",
                1,
                posts(server, {"4M levels": ("/v1/completions", door.nested(DEEPEST).encode())}),
            ),
            (
                f"slow bodies ({args.slow_clients} clients, a byte a second)",
                args.slow_clients,
                slow_bodies(server, args.slow_clients, args.give_up_s),
            ),
            (
                "keep-alive after generation (20 connections)",
                20,
                connections(server, [("whole", WHOLE, "HTTP/1.1", [])] * 20),
            ),
            (
                "close and HTTP/1.0 (whole, stream, refused)",
                6,
                connections(
                    server,
                    [
                        (f"{k} {v}", body, *versions[v])
                        for k, body in kinds.items()
                        for v in versions
                    ],
                ),
            ),
            ("redirect", 1, redirect(server)),
        ]
        for name, requests, attack in attacks:
            load = door.load_average()
            result, health = door.beside_healthy_stream(server, attack)
            agrees = reference.startswith(health.text) or health.text.startswith(reference)
            row = {
                "attack": name,
                "requests": requests,
                "result": result,
                "attack_s": round(health.attack_s, 2),
                "max_gap_s": round(health.max_gap_s, 3),
                "rss_growth_mib": round(health.rss_growth_mib, 1),
                "stream_agrees": agrees,
                "load_average": load,
            }
            rows.append(row)
            print(
                f"{name:48s} {summary(result):34s} {health.attack_s:6.2f} s  "
                f"gap {health.max_gap_s:5.3f} s  +{health.rss_growth_mib:6.1f} MiB  "
                f"{'agrees' if agrees else 'DIFFERS'}  (load {load})",
                flush=True,
            )
        log = server.log()
        print(f"server log: {'a traceback' if 'Traceback' in log else 'no traceback'}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started = now()
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--slow-clients", type=int, default=8)
    parser.add_argument("--server-checkout", type=Path, help="serve this directory's code")
    parser.add_argument(
        "--give-up-s", type=float, default=60, help="a slow client's wait for an answer"
    )
    parser.add_argument("serve_args", nargs="*", help="asyncstep serve's flags (after --)")
    args = parser.parse_args(argv)
    rows = run(args)
    cases = [row_case(row, ["attack"]) for row in rows]
    extra = {"load_average_end": door.load_average()}
    write(record("door", argv, started, options=vars(args), cases=cases, extra=extra), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
