"""Grammar compilation as a bounded, cancellable resource (issue 22, item 1).

A budget is checked at the door before anything compiles (the issue's
attacks, at their full sizes: the check is cheap); a compile runs in a worker
process that is killed past its time or memory limit and replaced, and when
no request waits for it any more; compiled grammars are kept in a cache
bounded in bytes; compiles are taken round robin over the clients. Each
attack runs beside a healthy stream whose tokens must equal its tokens alone
and whose largest gap between chunks must stay under ``MAX_GAP_S``, and the
engine's process must not grow by more than ``MAX_RSS_GROWTH`` per attack.
The limits are lowered where the behaviour is the same at a smaller size;
``benchmarks/studies/grammar/grammar_attacks.py`` runs the full-size compiles.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import httpx
import msgspec
import pytest
from processes import alive, wait_gone

import asyncstep
from asyncstep import SamplingParams, StructuredOutputsParams
from asyncstep.config import StructuredOutputsConfig
from asyncstep.engine.core.engine_core import EngineCore
from asyncstep.engine.structured_output.fair_queue import FairQueue
from asyncstep.engine.structured_output.grammar_budget import check_grammar_budget
from asyncstep.engine.structured_output.grammar_cache import GrammarKey
from asyncstep.engine.structured_output.manager import StructuredOutputManager
from asyncstep.errors import InvalidRequestError
from asyncstep.models.model_loader import LoadedModel
from asyncstep.server import build_app

pytestmark = pytest.mark.anyio

T = TypeVar("T")

#: The healthy stream's largest gap between two chunks, during any attack
#: (on a machine too busy to give the stream a step in ``MAX_GAP_S /
#: GAP_STEPS``, alone: ``GAP_STEPS`` of its median steps alone).
MAX_GAP_S = 1.0
GAP_STEPS = 20
#: The engine process's growth (resident memory) per attacking request.
MAX_RSS_GROWTH = 300 << 20
HEALTHY_PROMPT = "Count from one to twenty, in words."
HEALTHY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
#: A grammar of a few characters that compiles for seconds (a bounded
#: repetition of a broad class: every token is possible at each step).
SLOW_REGEX = "[^x]{1,100000}"
CHOICE = StructuredOutputsParams(choice=["yes", "no", "maybe"])


@pytest.fixture
def anyio_backend() -> str:
    return "trio"


def structured(spec: dict[str, Any], max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec)
    )


def manager_of(engine: asyncstep.Engine) -> StructuredOutputManager:
    assert isinstance(engine.core, EngineCore)  # in-process: a preloaded model
    return engine.core.structured_output


def rss() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Poll ``check`` (another process, or the engine's state) until it holds."""
    with anyio.fail_after(timeout_s):
        while not check():  # noqa: ASYNC110  # polling processes, with a deadline
            await anyio.sleep(0.02)


async def refusal(engine: asyncstep.Engine, spec: dict[str, Any], client: str = "") -> str:
    """The one-line error of a request with ``spec``'s grammar."""
    with pytest.raises(InvalidRequestError) as refused:
        await engine.generate("Hi", structured(spec), client=client)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("structured_outputs.")
    return message


async def stream_healthy(engine: asyncstep.Engine) -> tuple[list[int], list[float]]:
    """The healthy request's tokens, and the gaps between its chunks."""
    tokens: list[int] = []
    gaps: list[float] = []
    last = None
    async for chunk in engine.stream(HEALTHY_PROMPT, HEALTHY):
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        tokens += chunk.token_ids
    return tokens, gaps


async def beside_healthy(engine: asyncstep.Engine, attack: Callable[[], Awaitable[T]]) -> T:
    """Run ``attack`` while a healthy request streams again and again (at
    least once, until the attack is over): each run's tokens must equal
    the request's alone, and no gap between two chunks may pass
    ``MAX_GAP_S`` (see ``GAP_STEPS``); the engine's process may not grow by
    more than ``MAX_RSS_GROWTH``."""
    alone, alone_gaps = await stream_healthy(engine)
    bound = max(MAX_GAP_S, GAP_STEPS * statistics.median(alone_gaps))
    before = rss()
    gaps: list[float] = []
    over = anyio.Event()

    async def healthy() -> None:
        while True:
            tokens, run_gaps = await stream_healthy(engine)
            assert tokens == alone
            gaps.extend(run_gaps)
            if over.is_set():
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(healthy)
        try:
            result = await attack()
        finally:
            over.set()
    assert gaps and max(gaps) <= bound, f"largest gap {max(gaps):.2f} s (bound {bound:.2f} s)"
    assert rss() - before <= MAX_RSS_GROWTH
    return result


# -- the budget ----------------------------------------------------------------


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def tool_calls_schema(tools: int, arguments: int) -> dict[str, Any]:
    """A real-world shape: one of ``tools`` calls, each with its arguments."""
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f"tool_{t}"},
                    "arguments": {
                        "type": "object",
                        "properties": {
                            f"arg_{a}": {"type": ["string", "null"], "maxLength": 64}
                            for a in range(arguments)
                        },
                        "required": [f"arg_{a}" for a in range(arguments)],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "arguments"],
            }
            for t in range(tools)
        ]
    }


def properties(count: int) -> dict[str, Any]:
    names = [f"p{i}" for i in range(count)]
    return {
        "type": "object",
        "properties": {name: {"type": "integer"} for name in names},
        "required": names,
    }


#: The issue's attacks at their sizes (each body under 1 MB), and the limit
#: each one meets first at the defaults.
ATTACKS: dict[str, tuple[dict[str, Any], str]] = {
    "regex of 100k alternatives": (
        {"regex": "|".join(f"w{i}x" for i in range(100_000))},
        "grammar_max_bytes",
    ),
    "regex of 5k alternatives": (
        {"regex": "|".join(f"w{i}" for i in range(5000))},
        "grammar_max_alternatives",
    ),
    "choice of 1024 x 1000 characters": (
        {"choice": [f"{i:04d}" + "x" * 996 for i in range(1024)]},
        "grammar_max_bytes",
    ),
    "schema of 25k required properties": (
        {"json": properties(25_000)},
        "grammar_max_bytes",
    ),
    "schema of 3000 properties": ({"json": properties(3000)}, "grammar_max_properties"),
    "schema 40 deep": ({"json": nested_schema(40)}, "grammar_max_depth"),
    "regex 40 groups deep": ({"regex": "(" * 40 + "a" + ")" * 40}, "grammar_max_depth"),
    "enum of 5000 values": (
        {"json": {"enum": [f"v{i}" for i in range(5000)]}},
        "grammar_max_alternatives",
    ),
    "pattern of 5000 alternatives": (
        {"json": {"type": "string", "pattern": "|".join(f"p{i}" for i in range(5000))}},
        "grammar_max_alternatives",
    ),
    "patternProperties of 5000 alternatives": (
        {"json": {"type": "object", "patternProperties": {"|".join(map(str, range(5000))): {}}}},
        "grammar_max_alternatives",
    ),
    "grammar of 5000 alternatives": (
        {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(5000))},
        "grammar_max_alternatives",
    ),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_the_budget_names_the_limit_an_attack_passes(name: str) -> None:
    spec, limit = ATTACKS[name]
    with pytest.raises(InvalidRequestError, match=re.escape(f"({limit})")) as refused:
        check_grammar_budget(StructuredOutputsParams(**spec), StructuredOutputsConfig())
    assert "\n" not in str(refused.value)


def test_a_schema_400_deep_is_refused_by_its_json_nesting_first() -> None:
    """Every schema's JSON is bounded (``checks.MAX_JSON_DEPTH``) before the
    budget reads it: a 400-deep one (~5 s of xgrammar as text) is refused at once."""
    with pytest.raises(InvalidRequestError, match="nests more than 128 levels deep"):
        StructuredOutputsParams(json=json.dumps(nested_schema(400)))


@pytest.mark.parametrize(
    "spec",
    [
        {"json": tool_calls_schema(tools=64, arguments=16)},  # 1024 arguments
        {"json": nested_schema(32)},
        {"json": properties(1500)},
        {"regex": r"(\+\d{1,3} )?\(?\d{3}\)?[ .-]?\d{3}[ .-]?\d{4}"},
        {"regex": "|".join(f"label_{i}" for i in range(4000))},
        {"choice": [f"category {i}: " + "x" * 40 for i in range(1024)]},
        {"grammar": 'root ::= "(" root ")" | [a-z]+ ("|" [a-z]+)*'},
        {"json_object": True},
    ],
    ids=["tools", "deep_form", "wide_form", "phone", "labels", "choice", "ebnf", "object"],
)
def test_real_world_grammars_pass_the_budget(spec: dict[str, Any]) -> None:
    check_grammar_budget(StructuredOutputsParams(**spec), StructuredOutputsConfig())


def test_the_budget_skips_quoted_and_escaped_parentheses_and_bars() -> None:
    budget = StructuredOutputsConfig(grammar_max_alternatives=1, grammar_max_depth=1)
    check_grammar_budget(StructuredOutputsParams(regex=r"(\(\(\||[(|])a)"), budget)
    ebnf = 'root ::= ("(((" | "|||") [(|] "\\""'
    check_grammar_budget(StructuredOutputsParams(grammar=ebnf), budget)
    with pytest.raises(InvalidRequestError, match="has 2 alternatives"):
        check_grammar_budget(StructuredOutputsParams(regex="a|b|c"), budget)


async def test_attacks_are_refused_at_the_door_before_anything_compiles(
    smollm2: LoadedModel,
) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        pool = manager_of(engine).pool
        await engine.generate("Hi", SamplingParams(max_tokens=2))
        assert pool.worker_pids == []  # workers start with the first grammar

        async def attacks() -> list[str]:
            return [await refusal(engine, spec) for spec, _ in ATTACKS.values()]

        messages = await beside_healthy(engine, attacks)
        for message, (_, limit) in zip(messages, ATTACKS.values(), strict=True):
            assert f"({limit})" in message
        stats = pool.statistics()
        assert stats.num_workers_started == 0 and pool.num_jobs == 0  # nothing compiled

        # Over HTTP: a one-line 400 naming the field and the limit.
        transport = httpx.ASGITransport(app=build_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": "Hi", "structured_outputs": ATTACKS["regex of 5k alternatives"][0]}
            response = await client.post("/v1/completions", json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "structured_outputs"
        assert "(grammar_max_alternatives)" in error["message"]

        # Real-world grammars pass, compile and constrain.
        tools = await engine.generate(
            "Call a tool.", structured({"json": tool_calls_schema(32, 8)})
        )
        deep = await engine.generate("Fill the form.", structured({"json": nested_schema(32)}))
        assert tools.finish_reason and deep.finish_reason
        assert pool.statistics().num_compiled == 2 and len(pool.worker_pids) == 1


# -- the limits of a compile ----------------------------------------------------


async def test_a_compile_past_its_time_limit_is_killed_and_its_worker_replaced(
    smollm2: LoadedModel,
) -> None:
    async with asyncstep.open_engine(smollm2, grammar_compile_timeout_s=0.5) as engine:
        pool = manager_of(engine).pool
        assert (await engine.generate("Yes?", structured({"choice": ["yes", "no"]}))).text
        (first,) = pool.worker_pids

        message = await beside_healthy(engine, lambda: refusal(engine, {"regex": SLOW_REGEX}))
        assert message in (
            "structured_outputs.regex: its grammar did not compile within 0.5 s of CPU time "
            "(grammar_compile_timeout_s)",
            # A machine too busy to give the worker its 0.5 s within 5 s:
            "structured_outputs.regex: its grammar did not compile within 5 s "
            "(10 x grammar_compile_timeout_s: the machine is busy)",
        )
        assert not alive(first)  # killed and reaped before the refusal
        stats = pool.statistics()
        assert stats.num_timed_out == 1 and stats.num_workers_killed == 1
        after = await engine.generate("A code?", structured({"regex": "[0-9]{3}"}))
        assert re.fullmatch("[0-9]{3}", after.text)
        assert pool.worker_pids and pool.worker_pids != [first]  # a fresh worker


async def test_a_compile_past_its_memory_limit_is_killed_and_its_worker_replaced(
    smollm2: LoadedModel,
) -> None:
    options = {"grammar_compile_memory_mib": 16, "grammar_max_bytes": 1 << 20}
    async with asyncstep.open_engine(smollm2, **options) as engine:
        pool = manager_of(engine).pool
        assert (await engine.generate("Yes?", structured({"choice": ["yes", "no"]}))).text
        (first,) = pool.worker_pids
        rng = random.Random(0)
        heavy = ["".join(rng.choices("abcdefghij", k=1000)) for _ in range(128)]

        message = await beside_healthy(engine, lambda: refusal(engine, {"choice": heavy}))
        assert message == (
            "structured_outputs.choice: its grammar took more than 16 MiB to compile "
            "(grammar_compile_memory_mib)"
        )
        assert not alive(first)  # killed and reaped before the refusal
        assert pool.statistics().num_over_memory == 1
        after = await engine.generate("Yes?", structured({"choice": ["yes", "no"]}))
        assert after.text in ("yes", "no") and pool.worker_pids != [first]

        # A worker that dies in a compile (as a crash of xgrammar would): its
        # requests are refused, the engine serves on.
        async def crash() -> str:
            refused: list[str] = []

            async def run() -> None:
                refused.append(await refusal(engine, {"regex": SLOW_REGEX}))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await wait_until(  # a fresh worker, if the last kept memory: seconds
                    lambda: pool.num_running == 1 and bool(pool.worker_pids),
                    "a worker to compile",
                    timeout_s=60,
                )
                os.kill(pool.worker_pids[0], signal.SIGKILL)
            return refused[0]

        message = await beside_healthy(engine, crash)
        assert message == (
            "structured_outputs.regex: the grammar compile worker died (killed by signal SIGKILL)"
        )
        assert pool.statistics().num_worker_deaths == 1 and pool.num_jobs == 0


async def test_no_compile_runs_on_after_its_request_is_gone(smollm2: LoadedModel) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        manager = manager_of(engine)
        pool = manager.pool
        assert (await engine.generate("Yes?", structured({"choice": ["yes", "no"]}))).text

        async def abort_while_compiling(regex: str, *, shared: bool) -> Any:
            """A request for ``regex`` goes away while its grammar compiles;
            with ``shared``, another request waits for the same grammar (its
            completion is returned)."""
            leaving = anyio.CancelScope()
            other: list[asyncstep.Completion] = []

            async def leave() -> None:
                with leaving:
                    await engine.generate("Hi", structured({"regex": regex}))

            async def stay() -> None:
                other.append(await engine.generate("Hi", structured({"regex": regex})))

            async with anyio.create_task_group() as tg:
                tg.start_soon(leave)
                if shared:
                    tg.start_soon(stay)
                waiting = 2 if shared else 1
                await wait_until(
                    lambda: pool.num_running == 1 and pool.num_waiting == waiting,
                    "the compile to run",
                )
                leaving.cancel()
            return other[0] if other else None

        async def attack() -> None:
            # Another request waits for the same grammar: its compile goes on.
            shared = await abort_while_compiling("[^y]{1,64}", shared=True)
            assert re.fullmatch("[^y]{1,64}", shared.text)
            assert pool.statistics().num_workers_killed == 0
            # The only one goes: the worker compiling it is killed, nothing is built.
            (worker,) = pool.worker_pids
            await abort_while_compiling(SLOW_REGEX, shared=False)
            await wait_until(lambda: not alive(worker), "the worker to die", timeout_s=2)
            assert pool.num_jobs == 0 and pool.worker_pids == []

        await beside_healthy(engine, attack)
        stats = pool.statistics()
        assert stats.num_cancelled == 1 and stats.num_workers_killed == 1
        assert manager.cache.get(GrammarKey("regex", SLOW_REGEX)) is None


async def test_the_cache_stays_within_its_bytes(smollm2: LoadedModel) -> None:
    async with asyncstep.open_engine(smollm2, grammar_cache_mib=1) as engine:
        manager = manager_of(engine)
        bound = 1 << 20

        async def compile_many() -> None:
            for i in range(6):  # ~0.2 MiB each
                regex = f"v{i}[0-9]{{3}}-[a-z]{{2,5}}"
                await engine.generate("A code?", structured({"regex": regex}, max_tokens=4))
                assert manager.cache.num_bytes <= bound

        await beside_healthy(engine, compile_many)
        stats = manager.cache.statistics()
        assert stats.num_evicted > 0 and 0 < stats.num_bytes <= bound
        compiled = manager.pool.statistics().num_compiled
        again = await engine.generate("A code?", structured({"regex": "v5[0-9]{3}-[a-z]{2,5}"}))
        assert again.text and manager.pool.statistics().num_compiled == compiled  # a hit
        await engine.generate("Hi", structured({"regex": "a[^x]{1,64}"}, max_tokens=2))
        assert manager.cache.num_bytes <= bound  # a grammar larger than the bound is not kept


# -- fairness -------------------------------------------------------------------


async def test_the_fair_queue_takes_clients_in_turn() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3", "a4"):
        queue.put("A", item)
    taken = []
    client, item = await queue.get()  # one server: A's first is in service
    queue.put("B", "b1")  # B and C come meanwhile
    queue.put("C", "c1")
    assert queue.remove("A", "a3") and not queue.remove("A", "a9")
    while True:
        taken.append(item)
        queue.done(client)
        try:
            client, item = queue.get_nowait()
        except anyio.WouldBlock:
            break
    assert taken == ["a1", "b1", "c1", "a2", "a4"]


async def test_one_client_alone_keeps_every_server_busy() -> None:
    queue: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        queue.put("A", item)
    assert [await queue.get(), await queue.get()] == [("A", "a1"), ("A", "a2")]
    queue.put("B", "b1")
    queue.done("A")
    assert queue.get_nowait() == ("B", "b1")  # fewer in service than A
    assert queue.get_nowait() == ("A", "a3") and len(queue) == 0


async def test_one_clients_compiles_do_not_delay_anothers_past_one_compile(
    smollm2: LoadedModel,
) -> None:
    async with asyncstep.open_engine(smollm2) as engine:
        pool = manager_of(engine).pool
        assert (await engine.generate("Yes?", structured({"choice": ["yes", "no"]}))).text
        finished: list[str] = []

        async def run(client: str, name: str, regex: str) -> None:
            await engine.generate("Hi", structured({"regex": regex}, max_tokens=1), client=client)
            finished.append(name)

        async def clients() -> None:
            async with anyio.create_task_group() as tg:
                for c in "abc":  # a fraction of a second each
                    tg.start_soon(run, "A", f"A-{c}", f"{c}[^x]{{1,64}}")
                await wait_until(
                    lambda: pool.num_running == 1 and pool.num_jobs == 3, "A's compiles to queue"
                )
                tg.start_soon(run, "B", "B", "d[^x]{1,64}")

        await beside_healthy(engine, clients)
        # B's compile waits for the one of A's running when it came, then runs.
        assert finished.index("B") <= 1, finished


# -- the worker processes -------------------------------------------------------


def test_a_worker_dies_with_the_engine_core() -> None:
    """A worker whose parent (the engine core) is killed exits: its stdin,
    a pipe from the parent, closes."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, subprocess, sys, time\n"
            "ours, theirs = socket.socketpair()\n"
            "worker = subprocess.Popen([sys.executable, '-m',"
            " 'asyncstep.engine.structured_output.grammar_worker',"
            " '--fd', str(theirs.fileno())], stdin=subprocess.PIPE, pass_fds=[theirs.fileno()])\n"
            "print(worker.pid, flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        assert alive(worker)
        parent.kill()
        parent.wait()
        assert wait_gone(worker, 30)
    finally:
        parent.kill()
        parent.wait()


def grammar_workers() -> set[int]:
    """The compile worker processes this process started (the engine core
    runs in it: a preloaded model), alive."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone
        if parent == os.getpid() and b"asyncstep.engine.structured_output.grammar_worker" in argv:
            found.add(int(entry))
    return {pid for pid in found if alive(pid)}


async def test_workers_stay_within_their_number_and_stop_when_idle(
    smollm2: LoadedModel,
) -> None:
    """Six new grammars at once with two workers: two worker processes
    start, and no more are alive as each request ends; each stops once it
    waited ``grammar_compile_idle_s`` for a compile (its memory, xgrammar
    and the vocabulary, goes with it); a new grammar starts one again, a
    grammar in the cache needs none."""
    options = {"grammar_compile_workers": 2, "grammar_compile_idle_s": 1.0}
    async with asyncstep.open_engine(smollm2, **options) as engine:
        pool = manager_of(engine).pool
        alive_at_ends: list[set[int]] = []

        async def code(i: int) -> None:
            regex = f"w{i}[0-9]{{3}}"
            out = await engine.generate("A code?", structured({"regex": regex}, max_tokens=6))
            assert re.fullmatch(regex, out.text)
            alive_at_ends.append(grammar_workers())

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(code, i)
        stats = pool.statistics()
        assert stats.num_compiled == 6 and stats.num_workers_started == 2  # one each slot
        assert all(len(pids) <= 2 for pids in alive_at_ends)
        started = set().union(*alive_at_ends, pool.worker_pids)
        await wait_until(lambda: not pool.worker_pids, "the idle workers to stop", timeout_s=60)
        assert not any(alive(pid) for pid in started) and not grammar_workers()
        assert pool.statistics().num_workers_idle == 2
        await code(0)  # in the cache: no worker
        assert pool.statistics().num_workers_started == 2 and not pool.worker_pids
        await code(6)  # new: a worker again
        assert pool.statistics().num_workers_started == 3


def test_the_config_refuses_limits_that_are_not_positive() -> None:
    with pytest.raises(asyncstep.ConfigError, match="grammar_compile_workers must be positive"):
        asyncstep.make_config(grammar_compile_workers=0)
    with pytest.raises(asyncstep.ConfigError, match="grammar_compile_timeout_s"):
        asyncstep.make_config(grammar_compile_timeout_s=0)
    with pytest.raises(asyncstep.ConfigError, match="grammar_compile_idle_s must be positive"):
        asyncstep.make_config(grammar_compile_idle_s=0)
    config = asyncstep.make_config(grammar_cache_mib=0, grammar_max_depth=8)
    assert config.structured_outputs.grammar_max_depth == 8
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=type(config)) == config
