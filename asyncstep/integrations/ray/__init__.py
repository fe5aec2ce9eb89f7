"""asyncstep on Ray (``pip install 'asyncstep[ray]'``): the ranks of a
TP x PP engine as Ray actors (:func:`open_ray_engine`, vLLM's
``--distributed-executor-backend ray``), and the OpenAI server as a Ray
Serve application (:func:`build_serve_app`), one Ray Serve replica per
engine.

Imports ray lazily: importing this package (or any module of it) imports
neither ray nor torch; each function imports ray when it runs. It may
import asyncstep's face, its server, the rank entry
(:mod:`asyncstep.nursery.rank_main`), the model's description (a layout's
check), the configs, the errors, the logging and the control plane's secret
helpers; nothing in asyncstep imports it.

What crosses Ray's wires is Ray's: an actor call's arguments and results
are pickled by Ray (here only strings, numbers and lists of them, and
msgspec's JSON of the configs). The engine and its ranks talk over
asyncstep's own control plane (msgspec, with the launch's secret), as
ranks started by torchrun do; nothing is unpickled on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncstep.integrations.ray.placement import RayPlacement

if TYPE_CHECKING:
    from asyncstep.integrations.ray.ranks import open_ray_engine
    from asyncstep.integrations.ray.serve import build_serve_app

__all__ = ["RayPlacement", "build_serve_app", "open_ray_engine"]


def __getattr__(name: str) -> Any:
    """The functions, imported when first used (their modules import the
    engine's front end)."""
    if name == "open_ray_engine":
        from asyncstep.integrations.ray import ranks

        return ranks.open_ray_engine
    if name == "build_serve_app":
        from asyncstep.integrations.ray import serve

        return serve.build_serve_app
    raise AttributeError(f"module 'asyncstep.integrations.ray' has no attribute {name!r}")
