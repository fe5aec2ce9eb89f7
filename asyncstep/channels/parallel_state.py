"""Process groups of this rank: the tensor-parallel (TP), pipeline-parallel
(PP) and expert-parallel (EP) groups, vLLM's ``GroupCoordinator`` shape.

Rank layout: ``rank = pp_rank * tp_size + tp_rank``. A TP group holds the
ranks of one pipeline stage; a PP group holds the ranks with the same
``tp_rank`` across stages (the "lanes"). Each group has a device group
(gloo on CPU, NCCL on CUDA) for tensors and a gloo CPU group for metadata.

A group of one rank needs no ``torch.distributed`` at all: its collectives are
the identity, so a single-rank run never initialises a process group. The
model's layers ask ``get_tp_group()`` / ``get_pp_group()`` / ``get_ep_group()``;
the rank's launcher sets them once (:func:`init_distributed`) before the model
is built.

The EP group is the TP group when expert parallelism is on (there is no
data parallelism to widen it), else a group of one: a MoE layer built under
an EP group of one is vLLM's TP layout (every expert on every rank).
"""

from __future__ import annotations

import datetime
import os
import socket
import urllib.parse
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from asyncstep.errors import ConfigError

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only those.
all_gather_into_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass(frozen=True)
class GroupCoordinator:
    """One process group seen from one of its ranks."""

    #: Global ranks of the group, in group order.
    ranks: tuple[int, ...]
    rank_in_group: int
    device_group: dist.ProcessGroup | None = None
    #: gloo group over the same ranks, for metadata (the device group on CPU).
    cpu_group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls) -> GroupCoordinator:
        return cls(ranks=(0,), rank_in_group=0)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.ranks[self.rank_in_group]

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next member (wrapping)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous member (wrapping)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group (in place); returns the sum."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        x = x.movedim(dim, 0).contiguous()
        out = torch.empty(
            (self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device
        )
        all_gather_into_tensor(out, x, group=self.device_group)
        return out.movedim(0, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over the group, and keep this rank's ``1/world_size`` slice along ``dim``."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        x = x.movedim(dim, 0).contiguous()
        if x.shape[0] % self.world_size:
            raise ValueError(
                f"reduce_scatter: size {x.shape[0]} not divisible by {self.world_size}"
            )
        out = torch.empty(
            (x.shape[0] // self.world_size, *x.shape[1:]), dtype=x.dtype, device=x.device
        )
        reduce_scatter_tensor(out, x, group=self.device_group)
        return out.movedim(0, dim)

    def all_to_all(
        self,
        x: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> torch.Tensor:
        """Send rows ``x[sum(input_split_sizes[:r]):...]`` (dim 0) to group
        rank ``r`` and return the rows every rank sent here, in group rank
        order (``output_split_sizes[r]`` from rank ``r``)."""
        out, work = self.all_to_all_async(x, output_split_sizes, input_split_sizes)
        if work is not None:
            work.wait()
        return out

    def all_to_all_async(
        self,
        x: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
    ) -> tuple[torch.Tensor, dist.Work | None]:
        """:meth:`all_to_all` started: (the output tensor, its ``Work``
        handle; None for a group of one, where the output is ``x``). Read
        the output only once the handle is done
        (:func:`asyncstep.device.work.wait_work`)."""
        if self.world_size == 1:
            return x, None
        x = x.contiguous()
        out = torch.empty((sum(output_split_sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(
            out,
            x,
            output_split_sizes,
            input_split_sizes,
            group=self.device_group,
            async_op=True,
        )
        return out, work

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


@dataclass(frozen=True)
class ParallelGroups:
    world: GroupCoordinator
    tp: GroupCoordinator
    pp: GroupCoordinator
    #: The TP group under expert parallelism, else a group of one.
    ep: GroupCoordinator = field(default_factory=GroupCoordinator.single)

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_in_group


_TP = GroupCoordinator.single()
_PP = GroupCoordinator.single()
_EP = GroupCoordinator.single()


def set_parallel_groups(
    tp: GroupCoordinator, pp: GroupCoordinator, ep: GroupCoordinator | None = None
) -> None:
    """Set this process's TP, PP and EP groups (once, before building the
    model); ``ep`` None: a group of one (no expert parallelism)."""
    global _TP, _PP, _EP
    _TP, _PP, _EP = tp, pp, ep or GroupCoordinator.single()


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_pp_group() -> GroupCoordinator:
    return _PP


def get_ep_group() -> GroupCoordinator:
    """The expert-parallel group: the TP group under expert parallelism,
    else a group of one."""
    return _EP


def check_layout(world_size: int, tp_size: int, pp_size: int) -> None:
    if tp_size < 1 or pp_size < 1:
        raise ConfigError("tensor and pipeline parallel sizes must be >= 1")
    if world_size != tp_size * pp_size:
        raise ConfigError(
            f"world size {world_size} is not tensor_parallel_size x pipeline_parallel_size "
            f"({tp_size} x {pp_size})"
        )


def init_distributed(
    *,
    rank: int,
    world_size: int,
    tp_size: int,
    pp_size: int,
    init_method: str,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    store_fd: int | None = None,
    enable_expert_parallel: bool = False,
) -> ParallelGroups:
    """Join the world, create every TP and PP group (device and CPU), and set
    this rank's (the EP group: the TP group where ``enable_expert_parallel``).
    Every rank calls it with the same sizes.

    ``init_method``: ``tcp://HOST:PORT``, ``env://`` (``MASTER_ADDR``,
    ``MASTER_PORT``) or ``file://PATH``. For the first two, rank 0 serves the
    rendezvous store on HOST only (:func:`open_tcp_store`; torch's own would
    listen on every interface), on ``store_fd`` when given: a socket already
    bound there, inherited from whoever chose the port (so that nothing else
    can take the port in between). Under torchrun (its agent serves the
    store) ``env://`` is left to torch."""
    check_layout(world_size, tp_size, pp_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = open_tcp_store(init_method, rank, world_size, timeout, store_fd)
    if store is None:
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    world = _make_group(list(range(world_size)), rank, backend, timeout, whole_world=True)
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    tp = pp = None
    # Every rank creates every group, in the same order (torch.distributed's rule).
    for stage in range(pp_size):
        ranks = [stage * tp_size + i for i in range(tp_size)]
        group = _make_group(ranks, rank, backend, timeout)
        if stage == pp_rank:
            tp = group
    for lane in range(tp_size):
        ranks = [stage * tp_size + lane for stage in range(pp_size)]
        group = _make_group(ranks, rank, backend, timeout)
        if lane == tp_rank:
            pp = group
    assert tp is not None and pp is not None
    ep = tp if enable_expert_parallel else GroupCoordinator.single()
    set_parallel_groups(tp, pp, ep)
    return ParallelGroups(world, tp, pp, ep)


def open_tcp_store(
    init_method: str,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    store_fd: int | None = None,
) -> dist.TCPStore | None:
    """The rendezvous store of ``init_method`` (``tcp://`` or ``env://``),
    served by rank 0 on that address alone; None for any other method, and for
    ``env://`` under torchrun's agent (which serves the store itself).

    torch's ``TCPStore`` server binds every interface (``::``) whatever host
    it is given, unless it is handed a socket: rank 0 binds one to HOST:PORT
    (or uses ``store_fd``, one already bound) and passes it on."""
    address = _store_address(init_method)
    if address is None:
        return None
    host, port = address
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if store_fd is None:
        store_fd = listening_socket(host, port).detach()
    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=store_fd
    )


def _store_address(init_method: str) -> tuple[str, int] | None:
    url = urllib.parse.urlsplit(init_method)
    if url.scheme == "tcp" and url.hostname is not None and url.port is not None:
        return url.hostname, url.port
    if url.scheme == "env" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        try:
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError):
            raise ConfigError("env:// needs MASTER_ADDR and MASTER_PORT (a port number)") from None
    return None


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: any free one) and listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def _make_group(
    ranks: list[int],
    rank: int,
    backend: str,
    timeout: datetime.timedelta,
    *,
    whole_world: bool = False,
) -> GroupCoordinator:
    device = None if whole_world else dist.new_group(ranks, backend=backend, timeout=timeout)
    cpu = device if backend == "gloo" else None
    if cpu is None:
        cpu = None if whole_world else dist.new_group(ranks, backend="gloo", timeout=timeout)
    member = rank in ranks
    return GroupCoordinator(
        ranks=tuple(ranks),
        rank_in_group=ranks.index(rank) if member else -1,
        device_group=device if member else None,
        cpu_group=cpu if member else None,
    )


def destroy_distributed() -> None:
    set_parallel_groups(GroupCoordinator.single(), GroupCoordinator.single())
    if dist.is_initialized():
        dist.destroy_process_group()
