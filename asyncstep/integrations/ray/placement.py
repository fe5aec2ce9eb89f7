"""Where the ranks of one engine go on a Ray cluster: a placement group of
one bundle per rank (``tensor_parallel_size x pipeline_parallel_size``),
reserved whole before any rank starts, so an engine never holds half its
ranks while waiting for the rest.

``strategy`` is Ray's: ``STRICT_PACK`` (the default: every rank on one
node, as on one machine with NCCL over NVLink), ``PACK`` (one node where it
fits, else several), ``SPREAD`` / ``STRICT_SPREAD`` (across nodes, one rank
a node at most for the strict one; pipeline stages on different hosts). A
bundle asks ``cpus_per_rank`` CPUs and ``gpus_per_rank`` GPUs (None: one
GPU when the engine's device is CUDA, else none). Inside a Ray Serve
replica built by :func:`~asyncstep.integrations.ray.build_serve_app`, the
replica's own placement group holds the ranks' bundles after its own
(bundle 0): a replica is reserved with its ranks.

Imports ray when a function runs; msgspec only at import.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from asyncstep.config import EngineConfig

Strategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]


class RayPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """How an engine's ranks are placed (see the module's docstring);
    ``ready_timeout_s``: how long to wait for the cluster to grant the
    bundles before giving up with a ``TimeoutError``; ``rank_env``: more
    environment for every rank (e.g. ``NCCL_SOCKET_IFNAME``; it wins over
    the launch's own, the secret and rendezvous excepted)."""

    strategy: Strategy = "STRICT_PACK"
    cpus_per_rank: float = 1.0
    gpus_per_rank: float | None = None
    ready_timeout_s: float = 300.0
    rank_env: dict[str, str] = msgspec.field(default_factory=dict)

    def bundle(self, config: EngineConfig) -> dict[str, float]:
        """One rank's bundle of resources."""
        gpus = self.gpus_per_rank
        if gpus is None:
            gpus = 1.0 if config.model.device.startswith("cuda") else 0.0
        bundle = {"CPU": self.cpus_per_rank}
        if gpus:
            bundle["GPU"] = gpus
        return bundle

    def bundles(self, config: EngineConfig) -> list[dict[str, float]]:
        return [self.bundle(config)] * config.parallel.world_size


class RankSlots(msgspec.Struct, frozen=True):
    """The bundles of a placement group the ranks take: rank ``i`` goes to
    bundle ``first + i``; ``owned``: the group is ours to remove."""

    group: Any  # ray.util.placement_group.PlacementGroup
    first: int
    owned: bool


def reserve(config: EngineConfig, placement: RayPlacement) -> RankSlots:
    """The ranks' bundles: those of the current placement group after its
    first (a Serve replica's, built with room for them), else a new group,
    once the cluster granted it (blocking: call it in a thread)."""
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group

    world = config.parallel.world_size
    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= world + 1:
        return RankSlots(current, 1, owned=False)
    group = placement_group(placement.bundles(config), strategy=placement.strategy)
    try:
        ray.get(group.ready(), timeout=placement.ready_timeout_s)
    except BaseException as exc:
        release(RankSlots(group, 0, owned=True))
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise TimeoutError(
                f"the Ray cluster did not grant {world} bundles of "
                f"{placement.bundle(config)} ({placement.strategy}) within "
                f"{placement.ready_timeout_s:g} s"
            ) from None
        raise
    return RankSlots(group, 0, owned=True)


def release(slots: RankSlots) -> None:
    """Give the bundles back (only a group made by :func:`reserve`)."""
    from ray.util.placement_group import remove_placement_group

    if slots.owned:
        remove_placement_group(slots.group)


def scheduling(slots: RankSlots, rank: int) -> Any:
    """Ray's scheduling strategy for ``rank``: its bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=slots.group,
        placement_group_bundle_index=slots.first + rank,
        placement_group_capture_child_tasks=False,
    )
