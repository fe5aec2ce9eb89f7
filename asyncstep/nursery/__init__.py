"""The rank actor: one nursery per rank whose long-lived tasks own the PP
receive channel, the runner step, deferred send completion and the sampler,
linked by memory channels; their supervision, cancellation and shutdown.

May import ``asyncstep.runner``, ``asyncstep.channels``, ``asyncstep.device``,
``asyncstep.logging``, anyio and trio.
"""

from asyncstep.nursery.rank import RankActor, RankStatistics

__all__ = ["RankActor", "RankStatistics"]
