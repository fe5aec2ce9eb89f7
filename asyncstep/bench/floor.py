"""The memory floor of decoding: the device-to-device copy bandwidth
measured here, and the bytes a decode step must read.

Floor per decode step = (the weight bytes the step reads + the KV bytes it
reads) / bandwidth, at the mean context over the decode. The weight bytes
are the loaded model's, as the engine reports them
(:class:`~asyncstep.datatypes.WeightReads`): a layer's packed copy (Q4/Q8
blocks, int4/int8) in a step small enough to use it, else its dense
weight; of the input embedding, the step's rows only. Without that report
(``--floor-only``: no engine) they come from the model's shapes, every
weight dense, and ``strict`` leaves out an untied input-embedding table but
the batch's rows (with it, ``strict`` is the floor). The throughput floor:
the largest output length in steps, each reading the weights at the number
of requests still decoding then, plus every request's KV reads. Bandwidth:
``dst.copy_(src)`` of a bf16 tensor, read + write bytes counted, median of
the repeats (CUDA events on CUDA, the wall clock on the CPU).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncstep.datatypes import WeightReads
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dummy import dummy_weight_shapes

if TYPE_CHECKING:
    import torch


def _time_copy(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of ``dst.copy_(src)``."""
    import torch

    if dst.device.type != "cuda":
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0
    with torch.cuda.device(dst.device):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


def copy_bandwidth(device: torch.device, gib: float, repeats: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` on a ``gib`` GiB bf16 tensor, read +
    write counted, median of ``repeats`` (after one untimed copy)."""
    import torch

    numel = int(gib * 2**30) // 2
    src = torch.ones(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    _time_copy(dst, src)
    seconds = statistics.median(_time_copy(dst, src) for _ in range(repeats))
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * numel * 2 / seconds


def weight_bytes(arch: ModelArchConfig, itemsize: int) -> tuple[int, int]:
    """(bytes of every parameter, bytes of an untied input-embedding table or 0)."""
    shapes = dummy_weight_shapes(arch)
    total = sum(math.prod(s) for s in shapes.values()) * itemsize
    embed = 0 if arch.tie_word_embeddings else math.prod(shapes["model.embed_tokens.weight"])
    return total, embed * itemsize


def kv_bytes_per_token(arch: ModelArchConfig, itemsize: int) -> int:
    return arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * itemsize


def step_weight_bytes(
    arch: ModelArchConfig, itemsize: int, num_tokens: int, reads: WeightReads | None
) -> tuple[int, int]:
    """(the weight bytes a step of ``num_tokens`` tokens reads, the same but
    an untied embedding table: its rows only): ``reads``' (both the same),
    else from the shapes, every weight dense."""
    if reads is not None:
        read = reads.step_bytes(num_tokens)
        return read, read
    weights, embed = weight_bytes(arch, itemsize)
    rows = num_tokens * arch.hidden_size * itemsize if embed else 0
    return weights, weights - embed + rows


def step_floor(
    arch: ModelArchConfig,
    itemsize: int,
    bandwidth: float,
    batch: int,
    context: float,
    tp: int = 1,
    reads: WeightReads | None = None,
) -> dict[str, float]:
    """Floor of one decode step of ``batch`` requests of ``context`` tokens
    each, on one GPU (``tp_floor_ms``: the bytes split evenly over ``tp``);
    ``reads``: the engine's report of its model's reads (see the module doc)."""
    weights, strict = step_weight_bytes(arch, itemsize, batch, reads)
    kv = batch * context * kv_bytes_per_token(arch, itemsize)
    floor_ms = (weights + kv) / bandwidth * 1e3
    return {
        "floor_ms": floor_ms,
        "strict_floor_ms": (strict + kv) / bandwidth * 1e3,
        "tp_floor_ms": floor_ms / tp,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "mean_context": context,
        "bandwidth_tb_s": bandwidth / 1e12,
    }


def throughput_floor(
    arch: ModelArchConfig,
    itemsize: int,
    bandwidth: float,
    in_lens: Sequence[int],
    out_lens: Sequence[int],
    reads: WeightReads | None = None,
) -> dict[str, float]:
    """Floor of a whole run: at least max(out_lens) decode steps, each
    reading the weights at the number of requests still decoding then, and
    each output token reads its request's context (``reads``: as for
    :func:`step_floor`)."""
    contexts = sum(o * (i + o / 2) for i, o in zip(in_lens, out_lens, strict=True))
    kv = contexts * kv_bytes_per_token(arch, itemsize)
    weights = strict = 0
    done = 0  # steps counted so far
    ends = sorted(out_lens)
    for finished, end in enumerate(ends):  # steps [done, end): len(ends) - finished decode
        if end > done:
            read, strict_read = step_weight_bytes(arch, itemsize, len(ends) - finished, reads)
            weights += (end - done) * read
            strict += (end - done) * strict_read
            done = end
    floor_s = (weights + kv) / bandwidth
    strict_s = (strict + kv) / bandwidth
    return {
        "floor_s": floor_s,
        "strict_floor_s": strict_s,
        "output_tok_s": sum(out_lens) / floor_s,
        "strict_output_tok_s": sum(out_lens) / strict_s,
        "weight_bytes": step_weight_bytes(arch, itemsize, len(out_lens), reads)[0],
        "run_weight_bytes": weights,
        "kv_bytes": kv,
        "bandwidth_tb_s": bandwidth / 1e12,
    }
