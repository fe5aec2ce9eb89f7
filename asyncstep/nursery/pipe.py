"""This rank's place in the pipeline: the PP transfers its actor's tasks use.

Wraps the tensor-dict channel (``asyncstep.channels.tensor_dict``) with the
rank's groups, device, buffer pool and the model's per-key lane choice, and
keeps the rule that a receive buffer goes back to the pool only once the
forward that read it is done (on CUDA, once an event recorded after the
forward has completed).

:class:`PendingReceive` is a step's receive while a thread is still posting
it: the step's host work (inputs, metadata, uploads) runs meanwhile, and only
the first use of the tensors waits for the post.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio
import torch

from asyncstep.channels.buffer_pool import BufferPool
from asyncstep.channels.parallel_state import GroupCoordinator
from asyncstep.channels.tensor_dict import (
    AsyncIntermediateTensors,
    PendingSend,
    drain,
    recv_tensor_dict,
    send_tensor_dict,
    warm_up,
)
from asyncstep.datatypes import IntermediateTensors
from asyncstep.runner.step_state import StepEvents

ReceivedTensors = AsyncIntermediateTensors


class PendingReceive(IntermediateTensors):
    """A step's intermediate tensors whose receive another thread is posting
    (metadata first, then the tensors' receives): the first use of the
    tensors blocks until it was posted, then waits for them as
    :class:`AsyncIntermediateTensors` does (on CUDA the stream waits, not the
    host). The runner prepares the step's inputs before it touches them, so
    that work no longer waits for the previous stage.
    """

    def __init__(self, step_id: int, future: concurrent.futures.Future[ReceivedTensors]) -> None:
        # IntermediateTensors.__init__ is not called: ``tensors`` is a property here.
        self.step_id = step_id
        self.future = future

    def __repr__(self) -> str:
        state = "posted" if self.future.done() else "posting"
        return f"PendingReceive(step={self.step_id}, {state})"

    def result(self) -> ReceivedTensors:
        """The posted receive (blocks until posted; raises what posting raised)."""
        return self.future.result()

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return self.result().tensors

    @tensors.setter
    def tensors(self, value: dict[str, torch.Tensor]) -> None:
        raise AttributeError("PendingReceive.tensors cannot be replaced")

    def keys(self) -> list[str]:
        return self.result().keys()

    def __len__(self) -> int:
        return len(self.result())


@dataclass
class SendInFlight:
    """One step's send, from its posting to its completion (``done``)."""

    pending: PendingSend
    step_id: int = -1
    #: The device events of the forward that made the tensors (for timelines).
    events: StepEvents | None = None
    done: anyio.Event = field(default_factory=anyio.Event)

    @property
    def on_device(self) -> bool:
        """The tensors go over NCCL: the next step orders itself after them
        on the device stream rather than on the host."""
        return self.pending.work.device is not None

    async def complete(self) -> None:
        """Wait for the send's handles; its buffers then go back to the pool."""
        await self.pending.wait(abandon_on_cancel=False)
        self.done.set()


class PipeStage:
    def __init__(
        self,
        pp: GroupCoordinator,
        tp: GroupCoordinator,
        device: torch.device,
        all_gather_keys: Mapping[str, bool],
        *,
        poison: bool = False,
    ) -> None:
        self.pp, self.tp, self.device = pp, tp, device
        self.all_gather_keys = dict(all_gather_keys)
        self.pool = BufferPool(poison=poison, name=f"pp-rank{pp.rank}")
        self._lock = threading.Lock()
        self._releases: list[tuple[ReceivedTensors, torch.cuda.Event]] = []
        #: Every send posted and not known complete, whoever holds it: a
        #: cancellation between posting and hand-over cannot lose one.
        self._posted: list[PendingSend] = []

    def warm_up(self) -> None:
        """Open the links to both neighbour stages (NCCL creates them lazily,
        and a first send whose receiver waits on something else deadlocks).
        Every rank of the PP group calls it once, before the first step."""
        warm_up(device=self.device, pp=self.pp)

    def post_receive(self, step_id: int) -> ReceivedTensors:
        """Receive a step's metadata and post the receives of its tensors
        (blocking until the metadata arrives: call it from a worker thread)."""
        self._release_finished()
        return recv_tensor_dict(
            pool=self.pool, device=self.device, step_id=step_id, pp=self.pp, tp=self.tp
        )

    def send(self, tensors: IntermediateTensors, step_id: int) -> PendingSend:
        """Post the non-blocking send of a step's intermediate tensors."""
        pending = send_tensor_dict(
            tensors,
            step_id=step_id,
            pool=self.pool,
            pp=self.pp,
            tp=self.tp,
            all_gather=self.all_gather_keys,
        )
        with self._lock:
            self._posted = [p for p in self._posted if not p.done]
            self._posted.append(pending)
        return pending

    def done_with(self, received: ReceivedTensors | PendingReceive) -> None:
        """The forward that read ``received`` was launched: its buffers may go
        back to the pool once that forward completed. A receive whose posting
        failed has nothing to give back."""
        if isinstance(received, PendingReceive):
            if received.future.exception() is not None:
                return
            received = received.result()
        if self.device.type != "cuda":
            received.release()  # the CPU forward has finished
            return
        event = torch.cuda.Event()
        event.record()
        with self._lock:
            self._releases.append((received, event))

    def _release_finished(self) -> None:
        """Give back the buffers of every forward known complete; each event
        is queried once (one that completes between two queries must land
        in one list or the other, or its buffers never come back)."""
        finished: list[ReceivedTensors] = []
        pending: list[tuple[ReceivedTensors, torch.cuda.Event]] = []
        with self._lock:
            for received, event in self._releases:
                if event.query():
                    finished.append(received)
                else:
                    pending.append((received, event))
            self._releases = pending
        for received in finished:
            received.release()

    async def drain(self, timeout_s: float) -> tuple[int, int]:
        """Complete every send still in flight (shielded, at most
        ``timeout_s``); returns (drained, in flight). Buffers of sends that
        did not complete stay out of the pool."""
        with self._lock:
            in_flight = [p for p in self._posted if not p.done]
        drained = await drain(in_flight, timeout_s) if in_flight else 0
        return drained, len(in_flight)
