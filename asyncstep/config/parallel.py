"""The parallel section: :class:`ParallelConfig` (tensor, pipeline, data
and expert parallelism). Imports msgspec and :mod:`asyncstep.errors` only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncstep.config.utils import field_doc
from asyncstep.errors import ConfigError

#: How the front end picks a data-parallel replica per request
#: (:mod:`asyncstep.engine.front_end.dp_router`).
DATA_PARALLEL_ROUTINGS = ("prefix", "load", "round-robin")
#: Most data-parallel replicas of one front end.
MAX_DATA_PARALLEL_SIZE = 64


class ParallelConfig(msgspec.Struct, kw_only=True):
    """Tensor and pipeline parallel sizes (rank = pp_rank * tp_size + tp_rank).

    ``sequence_parallel`` keeps the residual stream split along tokens over
    the TP group (Megatron-SP): reduce-scatter + all-gather in place of each
    all-reduce; steps are padded to a multiple of tensor_parallel_size. No
    effect without tensor parallelism.

    With more than one rank, the engine listens on ``listen`` (``HOST:PORT``,
    loopback and any free port by default) for its ranks' control
    connections, and starts them itself as local processes unless
    ``launch_ranks`` is False (ranks started elsewhere, e.g. by torchrun,
    connect to that address).

    ``enable_expert_parallel`` (vLLM's name): a MoE model's experts are
    sharded whole over the TP group (expert parallelism, EP = TP): each rank
    holds ``num_experts / tensor_parallel_size`` experts and token rows are
    dispatched to them and combined back with all-to-all
    (:mod:`asyncstep.models.layers.moe`). A no-op with one TP rank; refused
    for a dense model or an expert count the TP size does not divide.

    ``data_parallel_size`` (vLLM's name): that many engine cores, each with
    its own ranks (TP x PP) and KV cache, behind one front end; each request
    goes to one replica, picked by ``data_parallel_routing``
    (:mod:`asyncstep.engine.front_end.dp_router`; ``prefix``: the replica
    holding the request's longest prompt prefix unless its load exceeds the
    least loaded replica's by more than ``data_parallel_balance_threshold``).
    ``data_parallel_rank`` set: this engine is that one replica (its CPU
    threads a ``1 / data_parallel_size`` share), for a router outside.

    ``pp_tensor_lanes``: between pipeline stages with TP, each TP rank sends
    ``1 / tp_size`` of every replicated tensor to its peer and the receiving
    stage all-gathers (vLLM's way; pays where the stage-to-stage link is slower
    than the links inside a stage, e.g. stages on different hosts). False: each
    TP rank sends its whole tensors, no gather (faster on one NVLink host:
    ``benchmarks/studies/layout/README.md``).
    """

    tensor_parallel_size: Annotated[int, field_doc("tensor-parallel ranks per pipeline stage")] = 1
    pipeline_parallel_size: Annotated[int, field_doc("pipeline stages")] = 1
    sequence_parallel: Annotated[
        bool, field_doc("keep activations split along tokens over the TP group (Megatron-SP)")
    ] = False
    enable_expert_parallel: Annotated[
        bool,
        field_doc(
            "MoE models: shard the experts whole over the TP ranks and dispatch tokens "
            "to them with all-to-all (expert parallelism; no-op with one TP rank)"
        ),
    ] = False
    launch_ranks: Annotated[
        bool,
        field_doc(
            "start the ranks as local processes (off: wait for ranks started elsewhere, "
            "python -m asyncstep.rank, to connect)"
        ),
    ] = True
    listen: Annotated[
        str, field_doc("address the ranks connect to (HOST:PORT; port 0: any free port)")
    ] = "127.0.0.1:0"
    rank_log_level: Annotated[str, field_doc("console log level of the rank processes")] = "warning"
    rank_log_json: Annotated[
        str | None,
        field_doc("started ranks write every event as JSON lines to <this>.rank<N>; none: not"),
    ] = None
    pp_tensor_lanes: Annotated[
        bool,
        field_doc(
            "between stages, each TP rank sends 1/TP of a tensor and the next stage "
            "all-gathers (off: whole tensors, faster on one NVLink host)"
        ),
    ] = True
    engine_process: Annotated[
        bool,
        field_doc(
            "run the scheduler and the rank in a child process (the engine core); "
            "off keeps them in the caller's process (debugging, tests)"
        ),
    ] = True
    cpu_threads: Annotated[
        int | None,
        field_doc(
            "CPU: torch threads of each rank's forward; none: every core the process may "
            "use, divided among the ranks of this machine"
        ),
    ] = None
    data_parallel_size: Annotated[
        int, field_doc("engine cores (replicas, each with its own ranks) behind the front end")
    ] = 1
    data_parallel_routing: Annotated[
        str,
        field_doc(
            "how a request's replica is picked: by prompt prefix then load, by load alone "
            "(waiting*4 + running), or in turn",
            choices=DATA_PARALLEL_ROUTINGS,
        ),
    ] = "prefix"
    data_parallel_balance_threshold: Annotated[
        int,
        field_doc(
            "prefix routing: the replica holding the longest prefix is skipped when its "
            "load exceeds the least loaded one's by more than this"
        ),
    ] = 32
    data_parallel_rank: Annotated[
        int | None,
        field_doc(
            "this engine is that one replica of data_parallel_size (an outside router "
            "in front); none: all of them, behind this front end's router"
        ),
    ] = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ConfigError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if not 1 <= self.data_parallel_size <= MAX_DATA_PARALLEL_SIZE:
            raise ConfigError(
                f"data_parallel_size must be in [1, {MAX_DATA_PARALLEL_SIZE}], "
                f"got {self.data_parallel_size}"
            )
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTINGS:
            raise ConfigError(
                f"data_parallel_routing must be one of {DATA_PARALLEL_ROUTINGS}, "
                f"got {self.data_parallel_routing!r}"
            )
        rank = self.data_parallel_rank
        if rank is not None and not 0 <= rank < self.data_parallel_size:
            raise ConfigError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), got {rank}"
            )
        if self.data_parallel_balance_threshold < 0:
            raise ConfigError(
                "data_parallel_balance_threshold must be >= 0, "
                f"got {self.data_parallel_balance_threshold}"
            )
        replicas_here = self.data_parallel_size > 1 and rank is None
        if replicas_here and not self.engine_process:
            raise ConfigError(
                "data_parallel_size > 1 runs each replica's engine core in its own process "
                "(engine_process must be on)"
            )
        if replicas_here and not self.launch_ranks:
            raise ConfigError(
                "data_parallel_size > 1 starts each replica's ranks itself "
                "(launch_ranks must be on)"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads must be >= 1 (or none), got {self.cpu_threads}")
        host, sep, port = self.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"listen must be HOST:PORT, got {self.listen!r}")
        if self.data_parallel_size > 1 and self.world_size > 1 and int(port) != 0:
            raise ConfigError(
                "data_parallel_size > 1: each replica's ranks connect to a port of its own "
                f"(listen's port must be 0, got {self.listen!r})"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def listen_address(self) -> tuple[str, int]:
        """``listen`` as (host, port)."""
        host, _, port = self.listen.rpartition(":")
        return host, int(port)
