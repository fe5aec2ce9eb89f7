"""The engine core's structured outputs (vLLM's ``StructuredOutputManager``):
one grammar matcher per constrained request, advanced by the tokens each
step brings back, and the token bitmask of a step's constrained requests.

The core compiles a request's grammar before the scheduler sees the
request: first in a compile worker process, under a time and a memory limit
and killed when no request waits for it any more
(:mod:`asyncstep.engine.structured_output.grammar_pool`), then, within those limits, in a
thread of low priority here (the grammar the matchers use; a compiled
grammar does not cross processes cheaply: see
:mod:`asyncstep.engine.structured_output.grammar_worker`); compiled grammars are kept for
reuse in a cache bounded in bytes (:mod:`asyncstep.engine.structured_output.grammar_cache`).
Once a
step's predecessors are all back (so every matcher has accepted every token
sampled before it), :meth:`StructuredOutputManager.grammar_output` fills
the step's bitmask, while the ranks run its forward; the last stage applies
it in ``sample_tokens``. Matchers advance only on tokens the scheduler
accepted (those in its :class:`~asyncstep.engine.messages.core_messages.EngineCoreOutput`),
so preemptions need no rollback, and a late token dropped after a stop never
reaches a matcher. With a ``reasoning_parser``, a request's grammar
applies from the end of its thinking on: its :class:`ReasoningGate` takes
its tokens until then, and its rows allow every token
(:mod:`asyncstep.engine.structured_output.reasoning_gate`). May import numpy, anyio, the
grammar modules of ``asyncstep.engine``, the config and the data types.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from asyncstep.config import StructuredOutputsConfig
from asyncstep.datatypes import GrammarOutput, SchedulerOutput
from asyncstep.engine.structured_output.grammar import GrammarCompiler
from asyncstep.engine.structured_output.grammar_cache import GrammarCache, GrammarKey
from asyncstep.engine.structured_output.grammar_messages import NICENESS
from asyncstep.engine.structured_output.grammar_pool import CompilePool
from asyncstep.engine.structured_output.reasoning_gate import ReasoningGate, ReasoningMarkers
from asyncstep.errors import InvalidRequestError
from asyncstep.logging import get_logger
from asyncstep.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncstep.engine.messages.core_messages import EngineCoreOutput

log = get_logger("engine")

#: Requests from which a step's matchers are advanced and filled by a thread pool.
POOL_MIN_ROWS = 8


@dataclass
class StructuredOutputStats:
    num_bitmasks: int = 0
    num_rows: int = 0
    #: Seconds spent filling bitmasks.
    fill_s: float = 0.0
    #: Tokens a matcher refused (should stay 0: the bitmask forbids them).
    num_rejected_tokens: int = 0


class StructuredOutputManager:
    """Grammar matchers of the constrained requests of one engine core."""

    def __init__(
        self,
        load_tokenizer: Callable[[], PreTrainedTokenizerBase | None],
        vocab_size: int,
        stop_token_ids: Iterable[int],
        config: StructuredOutputsConfig | None = None,
        *,
        max_threads: int | None = None,
    ) -> None:
        """``load_tokenizer`` is called (in a worker thread) for the first
        constrained request only. ``config``: the compiles' limits and the
        cache's size. ``max_threads``: xgrammar's threads for one compile (in
        a worker, then here; None: up to 8, the CPU count)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.config = config if config is not None else StructuredOutputsConfig()
        self.max_threads = max_threads or min(8, os.cpu_count() or 1)
        self._compiler: GrammarCompiler | None = None
        self._vocabulary: str = ""
        #: Compiled grammars kept for reuse.
        self.cache = GrammarCache(self.config.grammar_cache_mib << 20)
        #: The compile workers (started with the first grammar not in the cache).
        self.pool = CompilePool(
            self.config,
            vocabulary=self._get_vocabulary,
            build=self._build,
            max_threads=self.max_threads,
        )
        self._builder: ThreadPoolExecutor | None = None
        #: Threads advancing and filling shards of a large step (1: none).
        self.num_pool_threads = max(1, min(4, (os.cpu_count() or 1) // 2))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = anyio.Lock()  # one compiler build
        self.matchers: dict[str, Any] = {}  # req_id -> xgrammar.GrammarMatcher
        #: Requests still thinking (their grammar waits for the end of it).
        self.gates: dict[str, ReasoningGate] = {}
        self._markers: ReasoningMarkers | None = None
        self._stats = StructuredOutputStats()

    def statistics(self) -> StructuredOutputStats:
        return StructuredOutputStats(**vars(self._stats))

    # -- requests -----------------------------------------------------------

    async def run(self) -> None:
        """Serve the compiles until cancelled (then every worker is killed)."""
        await self.pool.run()

    async def compile(self, params: StructuredOutputsParams, client: Hashable = "") -> Any:
        """The compiled grammar of ``params`` (from the cache, or compiled
        among ``client``'s compiles: see :class:`CompilePool`);
        :class:`InvalidRequestError` (one line) when it does not compile or
        goes past a limit. Cancelling the caller withdraws the request."""
        key = GrammarKey.of(params)
        compiled = self.cache.get(key)
        if compiled is not None:
            return compiled
        return await self.pool.compile(key, client)

    async def _get_compiler(self) -> GrammarCompiler:
        async with self._lock:
            if self._compiler is None:
                self._compiler = await anyio.to_thread.run_sync(self._build_compiler)
            return self._compiler

    async def _get_vocabulary(self) -> str:
        """The vocabulary as xgrammar's JSON (a compile worker's setup)."""
        await self._get_compiler()
        return self._vocabulary

    async def _build(self, key: GrammarKey) -> Any:
        """Compile ``key`` here (its worker compiled it within the limits),
        in a thread of low priority; keep it in the cache."""
        compiler = await self._get_compiler()
        future = self._get_builder().submit(compiler.compile, key.kind, key.spec)
        compiled = await anyio.to_thread.run_sync(future.result)
        self.cache.put(key, compiled, int(compiled.memory_size_bytes))
        return compiled

    def _build_compiler(self) -> GrammarCompiler:
        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs need a tokenizer, and this model has none"
            )
        compiler = GrammarCompiler.from_tokenizer(
            tokenizer, self.vocab_size, self.stop_token_ids, max_threads=self.max_threads
        )
        self._vocabulary = compiler.serialize_vocabulary()
        log.info("grammar compiler ready", vocab_size=self.vocab_size)
        return compiler

    def _get_builder(self) -> ThreadPoolExecutor:
        if self._builder is None:
            self._builder = ThreadPoolExecutor(
                self.config.grammar_compile_workers,
                "grammar-build",
                initializer=_lower_priority,
            )
        return self._builder

    def add(self, req_id: str, compiled: Any, prompt_token_ids: Sequence[int] = ()) -> None:
        """Start ``req_id``'s matcher at the beginning of its grammar (with
        a ``reasoning_parser``: once the thinking its prompt leaves it in
        ends; see :meth:`ReasoningMarkers.gate`)."""
        import xgrammar as xgr

        self.matchers[req_id] = xgr.GrammarMatcher(compiled)
        markers = self._reasoning_markers()
        gate = None if markers is None else markers.gate(prompt_token_ids)
        if gate is not None:
            self.gates[req_id] = gate

    def _reasoning_markers(self) -> ReasoningMarkers | None:
        """The thinking's markers in the vocabulary (None: no reasoning
        parser); the compiler is built by then (it compiled the grammar)."""
        parser = self.config.reasoning_parser
        if parser is None:
            return None
        if self._markers is None:
            assert self._compiler is not None
            vocabulary = self._compiler.tokenizer_info.decoded_vocab
            self._markers = ReasoningMarkers(parser, vocabulary)
        return self._markers

    def remove(self, req_ids: Iterable[str]) -> None:
        matchers = self.matchers
        for req_id in req_ids:
            matchers.pop(req_id, None)
            self.gates.pop(req_id, None)

    # -- steps --------------------------------------------------------------

    def valid_drafts(self, req_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` that ``req_id``'s grammar accepts
        after the tokens its matcher has seen, none of which ends the grammar
        (a request without a grammar: all of them). The matcher is left as it
        was (rolled back)."""
        matcher = self.matchers.get(req_id)
        if matcher is None:
            return drafts
        gate = self.gates.get(req_id)
        if gate is not None and not gate.ended:
            return gate.valid_drafts(drafts)
        num_accepted = num_valid = 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_accepted += 1
            if matcher.is_terminated():
                break  # a stop token: the step's own token may be it
            num_valid += 1
        if num_accepted:
            matcher.rollback(num_accepted)
        return drafts[:num_valid]

    def constrains(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a request of the step follows a grammar."""
        matchers = self.matchers
        return bool(matchers) and any(r in matchers for r in scheduler_output.num_scheduled_tokens)

    def grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput:
        """The bitmask of the step's constrained requests (see :meth:`advance`);
        every earlier step's tokens must have been accepted."""
        output = self.advance((), scheduler_output)
        assert output is not None
        return output

    def advance(
        self, outputs: Iterable[EngineCoreOutput], next_step: SchedulerOutput | None = None
    ) -> GrammarOutput | None:
        """Advance the matchers by a step's accepted tokens (``outputs``),
        drop those of requests that ended, then (``next_step`` given) fill
        that step's bitmask: one row per constrained request still running,
        ``ceil(vocab_size / 32)`` int32 words, bit ``t`` allows token ``t``;
        a request with ``d`` draft tokens in the step has ``d + 1`` rows, in
        a row (its id repeated): row ``j`` after its drafts before ``j``
        (the matcher rolled back after).

        From ``POOL_MIN_ROWS`` requests on, shards of them are advanced and
        filled by a pool of threads, each request's accept before its fill
        (a large batch's host time falls with the threads:
        ``benchmarks/studies/structured/README.md``).
        """
        start = time.perf_counter()
        outputs = list(outputs)
        matchers = self.matchers
        gates = self.gates
        accepted = [
            (output.request_id, matchers[output.request_id], output.new_token_ids)
            for output in outputs
            if output.request_id in matchers
        ]
        req_ids: list[str] = []
        drafts: dict[str, list[int]] = {}
        if next_step is not None:
            ended = {output.request_id for output in outputs if output.finished}
            req_ids = [
                r for r in next_step.num_scheduled_tokens if r in matchers and r not in ended
            ]
            spec = next_step.scheduled_spec_decode_tokens
            drafts = {r: spec[r] for r in req_ids if r in spec} if spec else {}
        rows = [r for r in req_ids for _ in range(len(drafts.get(r, ())) + 1)]
        width = (self.vocab_size + 31) // 32
        bitmask = np.full((len(rows), width), -1, dtype=np.int32)
        work = _work_items(accepted, req_ids, matchers, drafts, gates)
        if len(work) >= POOL_MIN_ROWS and self.num_pool_threads > 1:
            shard = -(-len(work) // self.num_pool_threads)
            futures = [
                self._get_pool().submit(_advance_and_fill, work[lo : lo + shard], bitmask)
                for lo in range(0, len(work), shard)
            ]
            rejected = [r for future in futures for r in future.result()]
        else:
            rejected = _advance_and_fill(work, bitmask)
        self._note_rejected(rejected)
        for output in outputs:
            if output.finished:
                matchers.pop(output.request_id, None)
                gates.pop(output.request_id, None)
        for req_id in [r for r, gate in gates.items() if gate.ended]:
            del gates[req_id]
        if next_step is None:
            return None
        stats = self._stats
        stats.num_bitmasks += 1
        stats.num_rows += len(rows)
        stats.fill_s += time.perf_counter() - start
        return GrammarOutput(next_step.step_id, rows, bitmask.tobytes())

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_pool_threads, "grammar")
        return self._pool

    def _note_rejected(self, rejected: list[tuple[str, int]]) -> None:
        for req_id, token_id in rejected:
            self._stats.num_rejected_tokens += 1
            log.warning("grammar refused a sampled token", request_id=req_id, token_id=token_id)

    def close(self) -> None:
        """Let go of the threads; kill the compile workers still alive."""
        self.pool.kill_all()
        for executor in (self._pool, self._builder):
            if executor is not None:
                executor.shutdown(wait=False)
        self._pool = self._builder = None


def _lower_priority() -> None:
    """A grammar build thread yields the CPU to the engine's: ``NICENESS``
    more than the engine's (on Linux a thread has a niceness of its own,
    and the threads xgrammar starts for a compile inherit it)."""
    if sys.platform.startswith("linux"):
        thread = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, thread) + NICENESS
        os.setpriority(os.PRIO_PROCESS, thread, min(niceness, 19))


#: (request id, matcher, tokens to accept first, its first bitmask row or -1
#: for none, its draft tokens: a row after each, its reasoning gate or None).
_WorkItem = tuple[str, Any, list[int], int, list[int], ReasoningGate | None]


def _work_items(
    accepted: list[tuple[str, Any, list[int]]],
    req_ids: list[str],
    matchers: dict[str, Any],
    drafts: dict[str, list[int]],
    gates: dict[str, ReasoningGate],
) -> list[_WorkItem]:
    """One item per request: the tokens it accepts, then the rows it fills
    (``1 + drafts``, from its first row in ``req_ids`` order)."""
    row_of: dict[str, int] = {}
    row = 0
    for req_id in req_ids:
        row_of[req_id] = row
        row += 1 + len(drafts.get(req_id, ()))
    items: list[_WorkItem] = [
        (
            req_id,
            matcher,
            tokens,
            row_of.pop(req_id, -1),
            drafts.get(req_id, []),
            gates.get(req_id),
        )
        for req_id, matcher, tokens in accepted
    ]
    items += [
        (r, matchers[r], [], row, drafts.get(r, []), gates.get(r)) for r, row in row_of.items()
    ]
    return items


def _accept(
    req_id: str, matcher: Any, tokens: list[int], gate: ReasoningGate | None
) -> list[tuple[str, int]]:
    """Accept a step's tokens: those of the thinking go to its gate, the
    rest (and the bytes after the end marker) to the matcher; the tokens
    refused."""
    rejected = []
    for token_id in tokens:
        if gate is not None and not gate.ended:
            taken = gate.feed(token_id)
            if isinstance(taken, bytes):  # the thinking ended inside this token
                if taken and not matcher.accept_string(taken):
                    rejected.append((req_id, token_id))
                continue
            if taken is None:  # still thinking
                continue
        if not matcher.accept_token(token_id) and not matcher.is_terminated():
            rejected.append((req_id, token_id))
    return rejected


def _allow(bitmask: np.ndarray, row: int, token_id: int) -> None:
    """Allow ``token_id`` in bitmask row ``row`` too."""
    words = bitmask.view(np.uint32)
    words[row, token_id >> 5] |= np.uint32(1 << (token_id & 31))


def _advance_and_fill(items: list[_WorkItem], bitmask: np.ndarray) -> list[tuple[str, int]]:
    """Accept each item's tokens, then fill its rows (one, then one after
    each draft, rolled back after; a thinking request's stay all-allowed;
    one whose reply may open the thinking also allows its ``<think>``);
    the tokens refused."""
    rejected = []
    for req_id, matcher, tokens, row, drafts, gate in items:
        rejected += _accept(req_id, matcher, tokens, gate)
        if row < 0:
            continue
        if gate is not None and not gate.ended:
            if gate.opening is not None:  # (no drafts: see ReasoningGate.valid_drafts)
                matcher.fill_next_token_bitmask(bitmask, row)
                _allow(bitmask, row, gate.opening)
            continue  # thinking: every row allows every token
        matcher.fill_next_token_bitmask(bitmask, row)
        num_accepted = 0
        for offset, token_id in enumerate(drafts, start=1):
            if not matcher.accept_token(token_id):  # (checked when scheduled: never)
                rejected.append((req_id, token_id))
                break
            num_accepted += 1
            matcher.fill_next_token_bitmask(bitmask, row + offset)
        if num_accepted:
            matcher.rollback(num_accepted)
    return rejected
