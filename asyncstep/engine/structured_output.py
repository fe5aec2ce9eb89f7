"""The engine core's structured outputs (vLLM's ``StructuredOutputManager``):
one grammar matcher per constrained request, advanced by the tokens each
step brings back, and the token bitmask of a step's constrained requests.

The core compiles a request's grammar off its loop (a worker thread; the
same grammar compiles once) before the scheduler sees the request. Once a
step's predecessors are all back (so every matcher has accepted every token
sampled before it), :meth:`StructuredOutputManager.grammar_output` fills
the step's bitmask, while the ranks run its forward; the last stage applies
it in ``sample_tokens``. Matchers advance only on tokens the scheduler
accepted (those in its :class:`~asyncstep.engine.scheduler.EngineCoreOutput`),
so preemptions need no rollback, and a late token dropped after a stop never
reaches a matcher. May import numpy, anyio, ``asyncstep.engine.grammar`` and
the data types.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from asyncstep.datatypes import GrammarOutput, SchedulerOutput
from asyncstep.engine.grammar import GrammarCompiler
from asyncstep.errors import InvalidRequestError
from asyncstep.logging import get_logger
from asyncstep.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from asyncstep.engine.scheduler import EngineCoreOutput

log = get_logger("engine")

#: Rows from which one step's bitmask is filled by xgrammar's thread pool.
BATCH_FILL_MIN_ROWS = 8


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
        *,
        max_threads: int | None = None,
    ) -> None:
        """``load_tokenizer`` is called (in a worker thread) for the first
        constrained request only. ``max_threads``: xgrammar's threads for
        compiling and filling bitmasks (None: up to 8, the CPU count)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_threads = max_threads or min(8, os.cpu_count() or 1)
        self._compiler: GrammarCompiler | None = None
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, built with the compiler
        self._lock = anyio.Lock()  # one compiler build
        self.matchers: dict[str, Any] = {}  # req_id -> xgrammar.GrammarMatcher
        self._stats = StructuredOutputStats()

    def statistics(self) -> StructuredOutputStats:
        return StructuredOutputStats(**vars(self._stats))

    # -- requests -----------------------------------------------------------

    async def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params`` (compiled in a worker thread,
        once per grammar); :class:`InvalidRequestError` when it does not compile."""
        compiler = await self._get_compiler()
        return await anyio.to_thread.run_sync(compiler.compile, params.kind, params.spec)

    async def _get_compiler(self) -> GrammarCompiler:
        async with self._lock:
            if self._compiler is None:
                self._compiler = await anyio.to_thread.run_sync(self._build_compiler)
            return self._compiler

    def _build_compiler(self) -> GrammarCompiler:
        import xgrammar as xgr

        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError(
                "structured_outputs need a tokenizer, and this model has none"
            )
        compiler = GrammarCompiler(
            tokenizer, self.vocab_size, self.stop_token_ids, max_threads=self.max_threads
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=self.max_threads)
        log.info("grammar compiler ready", vocab_size=self.vocab_size)
        return compiler

    def add(self, req_id: str, compiled: Any) -> None:
        """Start ``req_id``'s matcher at the beginning of its grammar."""
        import xgrammar as xgr

        self.matchers[req_id] = xgr.GrammarMatcher(compiled)

    def remove(self, req_ids: Iterable[str]) -> None:
        matchers = self.matchers
        for req_id in req_ids:
            matchers.pop(req_id, None)

    # -- steps --------------------------------------------------------------

    def constrains(self, scheduler_output: SchedulerOutput) -> bool:
        """Whether a request of the step follows a grammar."""
        matchers = self.matchers
        return bool(matchers) and any(r in matchers for r in scheduler_output.num_scheduled_tokens)

    def grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput:
        """The bitmask of the step's constrained requests (those still
        running: a request that ended meanwhile has no row), one row each,
        ``ceil(vocab_size / 32)`` int32 words: bit ``t`` allows token ``t``.
        Every earlier step's tokens must have been accepted."""
        start = time.perf_counter()
        matchers = self.matchers
        req_ids = [r for r in scheduler_output.num_scheduled_tokens if r in matchers]
        width = (self.vocab_size + 31) // 32
        bitmask = np.full((len(req_ids), width), -1, dtype=np.int32)
        rows = [matchers[r] for r in req_ids]
        if len(rows) >= BATCH_FILL_MIN_ROWS and self._batch is not None:
            self._batch.batch_fill_next_token_bitmask(rows, bitmask)
        else:
            for index, matcher in enumerate(rows):
                matcher.fill_next_token_bitmask(bitmask, index)
        stats = self._stats
        stats.num_bitmasks += 1
        stats.num_rows += len(rows)
        stats.fill_s += time.perf_counter() - start
        return GrammarOutput(scheduler_output.step_id, req_ids, bitmask.tobytes())

    def accept(self, outputs: Iterable[EngineCoreOutput]) -> None:
        """Advance the matchers by a step's accepted tokens; drop those of
        requests that ended."""
        matchers = self.matchers
        for output in outputs:
            matcher = matchers.get(output.request_id)
            if matcher is None:
                continue
            for token_id in output.new_token_ids:
                if not matcher.accept_token(token_id) and not matcher.is_terminated():
                    self._stats.num_rejected_tokens += 1
                    log.warning(
                        "grammar refused a sampled token",
                        request_id=output.request_id,
                        token_id=token_id,
                    )
            if output.finished:
                del matchers[output.request_id]
