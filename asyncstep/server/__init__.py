"""asyncstep's OpenAI-compatible HTTP server (vLLM's ``vllm serve``).

* :mod:`~asyncstep.server.app`: the routes over one engine
  (:func:`build_app`, to mount in any ASGI app under Trio or asyncio);
  :mod:`~asyncstep.server.generation`: the generation requests in flight
  (admission, whole and streamed responses, disconnects, the graceful stop);
* :mod:`~asyncstep.server.protocol`: the request and response bodies;
  :mod:`~asyncstep.server.requests`: requests as engine prompts and
  sampling parameters; :mod:`~asyncstep.server.responses`: engine output as
  response bodies; :mod:`~asyncstep.server.sse`: event streams and
  disconnects; :mod:`~asyncstep.server.errors`: OpenAI's error shape;
* :mod:`~asyncstep.server.metrics`: Prometheus metrics, vLLM's names;
* :mod:`~asyncstep.server.config`: the server's options;
  :mod:`~asyncstep.server.serve`: ``asyncstep serve`` (one API server, or
  several); :mod:`~asyncstep.server.app_server`: one API server (Hypercorn's
  Trio worker, signals, graceful stop) and its listening socket;
  :mod:`~asyncstep.server.api_servers`: several API server processes on one
  port and one engine core.

It uses the engine's front end only (:class:`~asyncstep.engine.front_end.engine.Engine`,
``open_engine`` and its shared-core variants, the outputs,
``SamplingParams``, the errors (and a command's exit status) and configs,
the process helpers): never the engine core, the scheduler, the runner or the
ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncstep.server.config import ServerConfig

if TYPE_CHECKING:
    from asyncstep.server.app import OpenAIServer, build_app

__all__ = ["OpenAIServer", "ServerConfig", "build_app"]


def __getattr__(name: str) -> Any:
    """The app's names, imported when first used (so that the CLI's parser,
    which reads :mod:`asyncstep.server.config`, does not import the web stack)."""
    if name in ("OpenAIServer", "build_app"):
        from asyncstep.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'asyncstep.server' has no attribute {name!r}")
