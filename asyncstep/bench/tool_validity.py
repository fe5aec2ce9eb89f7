"""Forced tool calls are valid whatever is sampled: 200 seeded, sampled
(temperature 1) chat requests across 10 tool sets (nested objects, enums,
arrays, several tools, parallel calls), ``tool_choice`` ``required`` or a
named function, through the real ``openai`` client against the app (in this
process, over an ASGI transport) on the embedded model: every call must name
a tool of its request and its arguments validate against that tool's schema.
A reply cut by ``max_tokens`` is counted apart. ``--out``: ``asyncstep
bench``'s results format, a case per tool set; the totals (``summary``) and
every request's record in its ``extra``.

    python3 -m asyncstep.bench.tool_validity --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai

import asyncstep
from asyncstep.bench import measurement
from asyncstep.bench.results import Case, now, write
from asyncstep.server import build_app

MODEL = "SmolLM2-135M-Instruct"


def tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


STRING = {"type": "string", "maxLength": 32}
TOOL_SETS: list[tuple[str, list[dict[str, Any]], bool]] = [
    ("one string", [tool("search", obj({"query": STRING}))], False),
    (
        "enum and integer",
        [
            tool(
                "weather",
                obj(
                    {
                        "city": STRING,
                        "unit": {"enum": ["c", "f"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    }
                ),
            )
        ],
        False,
    ),
    (
        "nested object",
        [
            tool(
                "book",
                obj(
                    {
                        "guest": obj(
                            {
                                "name": STRING,
                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            }
                        ),
                        "nights": {"type": "integer", "minimum": 1, "maximum": 30},
                    }
                ),
            )
        ],
        False,
    ),
    (
        "array of strings",
        [
            tool(
                "tag",
                obj({"tags": {"type": "array", "items": STRING, "minItems": 1, "maxItems": 4}}),
            )
        ],
        False,
    ),
    (
        "array of objects",
        [
            tool(
                "order",
                obj(
                    {
                        "items": {
                            "type": "array",
                            "maxItems": 3,
                            "items": obj(
                                {
                                    "sku": STRING,
                                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                }
                            ),
                        }
                    }
                ),
            )
        ],
        False,
    ),
    (
        "booleans and optional",
        [
            tool(
                "alarm",
                obj(
                    {"time": STRING, "repeat": {"type": "boolean"}, "label": STRING},
                    required=["time"],
                ),
            )
        ],
        False,
    ),
    (
        "several tools",
        [
            tool("search", obj({"query": STRING})),
            tool("weather", obj({"city": STRING})),
            tool("clock", obj({"zone": STRING})),
        ],
        False,
    ),
    (
        "several tools, parallel",
        [tool("search", obj({"query": STRING})), tool("weather", obj({"city": STRING}))],
        True,
    ),
    (
        "numbers",
        [
            tool(
                "convert",
                obj(
                    {
                        "amount": {"type": "number", "minimum": 0, "maximum": 1e6},
                        "from": {"enum": ["usd", "eur"]},
                        "to": {"enum": ["usd", "eur"]},
                    }
                ),
            )
        ],
        False,
    ),
    (
        "no parameters",
        [tool("ping", {"type": "object", "properties": {}, "additionalProperties": False})],
        False,
    ),
]
QUESTIONS = [
    "Help me with this, using the tools.",
    "What should I do next?",
    "Use a tool for my request about Paris.",
    "Plan something for tomorrow.",
]


async def one(client: openai.AsyncOpenAI, index: int, max_tokens: int) -> dict[str, Any]:
    name, tools, parallel = TOOL_SETS[index % len(TOOL_SETS)]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    named = index % 2 == 1 and not parallel
    choice: Any = (
        {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        if named
        else "required"
    )
    out = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}],
        tools=tools,  # type: ignore[arg-type]
        tool_choice=choice,
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=index,
        max_tokens=max_tokens,
    )
    result = out.choices[0]
    record: dict[str, Any] = {
        "seed": index,
        "tool_set": name,
        "named": named,
        "finish_reason": result.finish_reason,
        "errors": [],
    }
    if result.finish_reason == "length":
        return record
    calls = result.message.tool_calls or []
    if not calls:
        record["errors"].append("no calls")
    for call in calls:
        function = call.function  # type: ignore[union-attr]
        if function.name not in schemas:
            record["errors"].append(f"unknown tool {function.name!r}")
            continue
        try:
            jsonschema.validate(json.loads(function.arguments), schemas[function.name])
        except (ValueError, jsonschema.ValidationError) as exc:
            record["errors"].append(f"{function.name}: {str(exc).splitlines()[0]}")
    record["calls"] = len(calls)
    return record


async def run(requests: int, concurrency: int, max_tokens: int) -> list[dict[str, Any]]:
    async with asyncstep.open_engine(max_model_len=2048) as engine:
        transport = httpx.ASGITransport(app=build_app(engine))
        http = httpx.AsyncClient(transport=transport, base_url="http://app", timeout=600)
        client = openai.AsyncOpenAI(base_url="http://app/v1", api_key="-", http_client=http)  # type: ignore[arg-type]
        gate = asyncio.Semaphore(concurrency)

        async def guarded(i: int) -> dict[str, Any]:
            async with gate:
                return await one(client, i, max_tokens)

        return await asyncio.gather(*(guarded(i) for i in range(requests)))


def by_tool_set(records: list[dict[str, Any]]) -> list[Case]:
    """A case per tool set: its requests, those cut by ``max_tokens``, those
    judged, the valid ones and their calls."""
    cases = []
    for name, _, _ in TOOL_SETS:
        mine = [r for r in records if r["tool_set"] == name]
        judged = [r for r in mine if r["finish_reason"] != "length"]
        row = {
            "tool_set": name,
            "requests": len(mine),
            "cut_by_max_tokens": len(mine) - len(judged),
            "judged": len(judged),
            "valid": sum(1 for r in judged if not r["errors"]),
            "calls": sum(r.get("calls", 0) for r in judged),
        }
        cases.append(measurement.row_case(row, ["tool_set"]))
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started = now()
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    records = asyncio.run(run(args.requests, args.concurrency, args.max_tokens))
    cut = [r for r in records if r["finish_reason"] == "length"]
    judged = [r for r in records if r["finish_reason"] != "length"]
    invalid = [r for r in judged if r["errors"]]
    summary = {
        "requests": len(records),
        "tool_sets": len(TOOL_SETS),
        "cut_by_max_tokens": len(cut),
        "judged": len(judged),
        "valid": len(judged) - len(invalid),
        "calls": sum(r.get("calls", 0) for r in judged),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    for record in invalid:
        print("INVALID", record)
    extra = {"summary": summary, "records": records}
    cases = by_tool_set(records)
    write(
        measurement.record(
            "tool_validity", argv, started, options=vars(args), cases=cases, extra=extra
        ),
        args.out,
    )
    return 0 if not invalid else 1


if __name__ == "__main__":
    raise SystemExit(main())
