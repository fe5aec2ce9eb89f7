"""The HBM floor of decoding: the device-to-device copy bandwidth measured
here, and the bytes a decode step must read.

Floor per decode step = (every weight byte + the KV bytes the step reads)
/ bandwidth, at the mean context over the decode; ``strict`` leaves out an
untied input-embedding table (only the batch's rows of it are read). The
throughput floor: the largest output length in steps, each reading every
weight, plus every request's KV reads. Bandwidth: ``dst.copy_(src)`` of a
bf16 tensor, read + write bytes counted, median of the repeats (CUDA
events on CUDA, the wall clock on the CPU).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

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


def step_floor(
    arch: ModelArchConfig,
    itemsize: int,
    bandwidth: float,
    batch: int,
    context: float,
    tp: int = 1,
) -> dict[str, float]:
    """Floor of one decode step of ``batch`` requests of ``context`` tokens
    each, on one GPU (``tp_floor_ms``: the bytes split evenly over ``tp``)."""
    weights, embed = weight_bytes(arch, itemsize)
    kv = batch * context * kv_bytes_per_token(arch, itemsize)
    rows = batch * arch.hidden_size * itemsize if embed else 0
    floor_ms = (weights + kv) / bandwidth * 1e3
    return {
        "floor_ms": floor_ms,
        "strict_floor_ms": (weights - embed + rows + kv) / bandwidth * 1e3,
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
) -> dict[str, float]:
    """Floor of a whole run: at least max(out_lens) decode steps each read
    every weight, and each output token reads its request's context."""
    weights, embed = weight_bytes(arch, itemsize)
    contexts = sum(o * (i + o / 2) for i, o in zip(in_lens, out_lens, strict=True))
    kv = contexts * kv_bytes_per_token(arch, itemsize)
    steps = max(out_lens)
    rows = len(out_lens) * arch.hidden_size * itemsize if embed else 0
    floor_s = (steps * weights + kv) / bandwidth
    strict_s = (steps * (weights - embed + rows) + kv) / bandwidth
    return {
        "floor_s": floor_s,
        "strict_floor_s": strict_s,
        "output_tok_s": sum(out_lens) / floor_s,
        "strict_output_tok_s": sum(out_lens) / strict_s,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "bandwidth_tb_s": bandwidth / 1e12,
    }
