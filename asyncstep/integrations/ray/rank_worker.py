"""One rank of an engine, in a Ray actor: :class:`RankWorker` is the
actor's class (made remote where it is started), and runs the rank entry
of ``python -m asyncstep.rank`` (:func:`asyncstep.nursery.rank_main.main`)
as torchrun's ranks run it: the rendezvous in the environment
(``MASTER_ADDR`` / ``MASTER_PORT``), the engine's control address and the
rank's place on its command line, the launch's secret in
``ASYNCSTEP_SECRET`` (which the rank drops from its environment).

Its methods take and return strings and numbers only. Imports ray when a
method runs; the rank entry (and so torch) when :meth:`RankWorker.serve`
runs.
"""

from __future__ import annotations

import os
import socket


class RankWorker:
    """A Ray actor's class: where it runs, a free port there, and the rank."""

    def where(self) -> tuple[str, str]:
        """This actor's Ray node id and that node's address."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        """A port on ``host`` free a moment ago (torch's store binds it
        later: another process may take it in between, as with torchrun's
        own choice of a port)."""
        with socket.socket() as sock:
            sock.bind((host, 0))
            return int(sock.getsockname()[1])

    def serve(self, argv: list[str], env: dict[str, str]) -> int:
        """Run the rank with ``argv`` (``python -m asyncstep.rank``'s) and
        ``env`` added to this process's environment, until the engine says
        stop; its exit status (0: stopped in order)."""
        from asyncstep.nursery.rank_main import main

        os.environ.update(env)
        return main(argv)
