"""The messages between the engine core's compile pool
(:mod:`asyncstep.engine.structured_output.grammar_pool`) and a compile worker
(:mod:`asyncstep.engine.structured_output.grammar_worker`): msgspec structs, msgpack frames
(never pickle). Core -> worker: :class:`WorkerSetup` once, then one
:class:`CompileGrammar` at a time; worker -> core: :class:`WorkerReady`,
then a :class:`GrammarCompiled` or :class:`GrammarRefused` per job.
Imports msgspec only.
"""

from __future__ import annotations

import msgspec

#: The worker's ``nice`` increment: compiles yield the CPU to the engine.
NICENESS = 10


class WorkerSetup(msgspec.Struct, frozen=True, tag=True):
    """The vocabulary (``TokenizerInfo.serialize_json()``) and xgrammar's threads."""

    vocabulary: str
    max_threads: int


class CompileGrammar(msgspec.Struct, frozen=True, tag=True):
    """Compile the grammar of ``kind`` and its text (``StructuredOutputsParams.spec``)."""

    kind: str
    spec: str


class WorkerReady(msgspec.Struct, frozen=True, tag=True):
    pass


class GrammarCompiled(msgspec.Struct, frozen=True, tag=True):
    """The grammar compiled: its size (xgrammar's ``memory_size_bytes``) and time."""

    memory_size_bytes: int
    compile_s: float


class GrammarRefused(msgspec.Struct, frozen=True, tag=True):
    """The grammar does not compile (one line: why)."""

    error: str


ToWorker = WorkerSetup | CompileGrammar
FromWorker = WorkerReady | GrammarCompiled | GrammarRefused
