"""The control plane between the engine and its ranks: typed messages
(msgspec structs, msgpack on the wire, never pickle) over a TCP connection,
framed by :class:`~asyncstep.channels.framing.MessageStream`.

A rank connects to the engine and, once both sides have proven that they
know the launch's secret (:func:`~asyncstep.channels.framing.accept_peer` /
:func:`~asyncstep.channels.framing.connect_peer`), says :class:`Hello`; the engine answers
with :class:`RankSetup` (its whole :class:`~asyncstep.config.EngineConfig`);
the rank loads its shard and reports :class:`RankReady` (how many KV blocks
fit); the engine sends :class:`InitKVCache` with the smallest count, then one
:class:`Step` per scheduler step to every rank. The driver rank (first TP
rank of the last pipeline stage) answers each with :class:`StepOutput`.
:class:`RankFailed` carries a rank's error; :class:`Shutdown` ends a rank.
"""

from __future__ import annotations

import msgspec

from asyncstep.channels.framing import MessageStream
from asyncstep.config import EngineConfig
from asyncstep.datatypes import GrammarOutput, ModelRunnerOutput, SchedulerOutput, WeightReads


class Hello(msgspec.Struct, frozen=True, tag=True):
    rank: int
    world_size: int
    pid: int
    host: str


class RankSetup(msgspec.Struct, frozen=True, tag=True):
    #: The engine's whole configuration, ``model.max_model_len`` resolved.
    config: EngineConfig
    #: torch.distributed rendezvous, e.g. ``tcp://127.0.0.1:29500`` (ranks
    #: the engine started); None: the rank's own (torchrun's MASTER_ADDR/MASTER_PORT).
    init_method: str | None


class RankReady(msgspec.Struct, frozen=True, tag=True):
    rank: int
    #: KV blocks this rank's memory holds.
    num_blocks: int
    weight_bytes: int
    device: str
    #: The weight bytes its forward steps read, by their size.
    weight_reads: WeightReads = msgspec.field(default_factory=WeightReads)


class InitKVCache(msgspec.Struct, frozen=True, tag=True):
    num_blocks: int


class Step(msgspec.Struct, frozen=True, tag=True):
    scheduler_output: SchedulerOutput


class Grammar(msgspec.Struct, frozen=True, tag=True):
    """A constrained step's bitmask, after its :class:`Step`."""

    grammar_output: GrammarOutput


class StepOutput(msgspec.Struct, frozen=True, tag=True):
    output: ModelRunnerOutput


class RankFailed(msgspec.Struct, frozen=True, tag=True):
    rank: int
    error: str


class Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


ControlMessage = (
    Hello
    | RankSetup
    | RankReady
    | InitKVCache
    | Step
    | Grammar
    | StepOutput
    | RankFailed
    | Shutdown
)

#: A control connection, from either side.
ControlStream = MessageStream[ControlMessage]
