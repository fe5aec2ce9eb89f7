"""Device-to-host copies that do not block the host: the sampled tokens'
(:mod:`asyncstep.runner.async_output`) and the prompt log-probs'
(:mod:`asyncstep.runner.prompt_logprobs`), on the copy stream
(:func:`copy_to_host`), or on the compute stream, in order with its work
(:func:`copy_to_host_in_order`: the FULL graphs' greedy ids, which the next
replay rewrites). May import torch and :mod:`asyncstep.device`.
"""

from __future__ import annotations

import torch

from asyncstep.device.stream import StreamEvent, record_event


def copy_to_host(
    tensors: list[torch.Tensor], copy_stream: torch.cuda.Stream | None
) -> tuple[list[torch.Tensor], StreamEvent]:
    """Non-blocking device-to-host copies of ``tensors`` on ``copy_stream``
    (after the work the current stream has enqueued so far), and the event
    that marks their end. On the CPU: the tensors themselves, complete."""
    if copy_stream is None:
        return tensors, record_event(None)
    copy_stream.wait_stream(torch.cuda.current_stream(copy_stream.device))
    with torch.cuda.stream(copy_stream):
        for tensor in tensors:
            # The allocator must not hand this memory out again before the copy read it.
            tensor.record_stream(copy_stream)
        hosts = _pinned_copies(tensors)
    return hosts, record_event(copy_stream.device, copy_stream)


def copy_to_host_in_order(
    tensors: list[torch.Tensor], device: torch.device
) -> tuple[list[torch.Tensor], StreamEvent]:
    """:func:`copy_to_host` on ``device``'s current stream: after the work
    enqueued so far, before any enqueued later (which may then overwrite
    ``tensors``); no stream switch. On the CPU: the tensors themselves."""
    if device.type != "cuda":
        return tensors, record_event(None)
    return _pinned_copies(tensors), record_event(device)


def _pinned_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Non-blocking copies of ``tensors`` into new pinned host tensors, on
    the current stream."""
    hosts = []
    for tensor in tensors:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        hosts.append(host)
    return hosts
