"""The forward of two micro-batches, interleaved layer by layer on two
streams, so that one micro-batch's tensor-parallel all-reduces (enqueued on
the communicator's stream) overlap the other's matmuls.

The host enqueues layer ``i`` of micro-batch 0 on the current stream, then
layer ``i`` of micro-batch 1 on a second stream, and so on: each stream
holds one micro-batch's work in order, and the device runs them side by
side. On the CPU the two simply run one after the other.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from asyncstep.datatypes import IntermediateTensors
from asyncstep.logging.spans import record_span, tracing
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.models.moe import MoeDecoderLayer
from asyncstep.ops.attention import AttentionMetadata
from asyncstep.ops.base import RotaryCosSin

__all__ = ["UBatchInputs", "forward_ubatches"]


@dataclass
class UBatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    intermediate_tensors: IntermediateTensors | None


@dataclass
class _State:
    """One micro-batch's residual stream between layers."""

    cos_sin: RotaryCosSin
    hidden: torch.Tensor
    residual: torch.Tensor | None


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def forward_ubatches(
    model: LlamaForCausalLM,
    ubatches: list[UBatchInputs],
    second_stream: torch.cuda.Stream | None,
) -> torch.Tensor | IntermediateTensors:
    """The stage output of the whole step (micro-batch outputs concatenated
    along tokens), as ``model(...)`` would return it."""
    streams = [None, second_stream]
    if second_stream is not None:
        second_stream.wait_stream(torch.cuda.current_stream())  # inputs are ready
    inner = model.model
    states = []
    for ub, stream in zip(ubatches, streams, strict=True):
        with _on(stream):
            hidden, residual = inner.begin(ub.input_ids, ub.intermediate_tensors)
            cos_sin = inner.rotary.cos_sin(ub.positions, hidden.dtype)
            states.append(_State(cos_sin, hidden, residual))
    for index, layer in enumerate(inner.stage_layers(), inner.start_layer):
        if isinstance(layer, MoeDecoderLayer) and layer.expert_parallel:
            _ep_layer(layer, index, ubatches, streams, states)
            continue
        for ub, stream, st in zip(ubatches, streams, states, strict=True):
            with _on(stream):
                st.hidden, st.residual = layer(st.cos_sin, st.hidden, st.residual, ub.attn_metadata)
    outputs = []
    for stream, st in zip(streams, states, strict=True):
        with _on(stream):
            outputs.append(inner.finish(st.hidden, st.residual))
    if second_stream is not None:
        torch.cuda.current_stream().wait_stream(second_stream)
        for out in outputs:  # made on the second stream, used on this one
            for t in out.tensors.values() if isinstance(out, IntermediateTensors) else [out]:
                t.record_stream(torch.cuda.current_stream())
    first, second = outputs
    if isinstance(first, IntermediateTensors):
        assert isinstance(second, IntermediateTensors)
        return IntermediateTensors({k: torch.cat([first[k], second[k]]) for k in first.tensors})
    assert isinstance(second, torch.Tensor)
    return torch.cat([first, second])


def _ep_layer(
    layer: MoeDecoderLayer,
    index: int,
    ubatches: list[UBatchInputs],
    streams: list[torch.cuda.Stream | None],
    states: list[_State],
) -> None:
    """An expert-parallel MoE layer over both micro-batches, in stages (see
    the module doc)."""
    stages = []  # the layer's MoE stage per micro-batch
    for ub, stream, st in zip(ubatches, streams, states, strict=True):
        with _on(stream):
            stage, st.residual = layer.begin_ep(
                st.cos_sin, st.hidden, st.residual, ub.attn_metadata
            )
            stages.append(stage)
    for stream, stage in zip(streams, stages, strict=True):
        with _on(stream):
            stage.compute()
    for i, (stream, stage, st) in enumerate(zip(streams, stages, states, strict=True)):
        with _on(stream):
            st.hidden = stage.finish()
        if tracing():
            for name, start, end in stage.intervals_us:
                record_span(f"ep_{name}", f"ubatch{i}", start, end - start, layer=index)
