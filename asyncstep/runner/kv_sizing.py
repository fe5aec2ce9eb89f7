"""How many paged KV blocks a rank can hold, and the host memory they take."""

from __future__ import annotations

import math
import mmap

import torch

from asyncstep.config import CacheConfig
from asyncstep.errors import ConfigError
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.memory import available_memory, human_bytes

#: GPU memory kept back for activations, beyond the estimate from the batch shape.
ACTIVATION_RESERVE_BYTES = 1 << 30


def num_kv_blocks(
    cache: CacheConfig,
    *,
    block_bytes: int,
    max_model_len: int,
    max_num_running_reqs: int,
    max_num_batched_tokens: int,
    arch: ModelArchConfig,
    device: torch.device,
    dtype: torch.dtype,
    num_kv_cache_groups: int = 1,
) -> int:
    """As configured, else what the memory allows: ``kv_cache_memory_gib`` on
    the CPU; on CUDA, ``gpu_memory_utilization`` of the device less the weights
    already loaded and an activation estimate. Never more than ``max_num_running_reqs``
    sequences of ``max_model_len`` tokens need (in each of ``num_kv_cache_groups``
    KV cache groups: ``block_bytes`` is one group's block)."""
    if cache.num_blocks is not None:
        return _fitting(cache.num_blocks, block_bytes, device)
    if device.type == "cuda":
        # The load's freed temporaries (dummy weights are drawn in float32)
        # sit in torch's cache, which the device counts as used: give them back.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        activations = (
            max_num_batched_tokens
            * ((4 * arch.hidden_size + 2 * _ffn_width(arch)) * dtype.itemsize)
            + max_num_running_reqs * arch.vocab_size * 4 * 3
        )
        budget = free - (1 - cache.gpu_memory_utilization) * total - activations
        budget -= ACTIVATION_RESERVE_BYTES
    else:
        budget = cache.kv_cache_memory_gib * 2**30
    blocks_per_seq = -(-max_model_len // cache.block_size) * num_kv_cache_groups
    num_blocks = min(int(budget // block_bytes), max_num_running_reqs * blocks_per_seq)
    if num_blocks < min(blocks_per_seq, 16):
        raise ConfigError(
            f"no memory left for the KV cache ({num_blocks} blocks); lower max_model_len "
            "or raise the KV cache memory"
        )
    return _fitting(num_blocks, block_bytes, device)


def _fitting(num_blocks: int, block_bytes: int, device: torch.device) -> int:
    """``num_blocks``, if the memory left on ``device`` holds them (checked before
    the cache is allocated)."""
    needed, free = num_blocks * block_bytes, available_memory(device)
    if free is not None and needed > free:
        raise ConfigError(
            f"the KV cache ({num_blocks} blocks) needs {human_bytes(needed)} on {device} but "
            f"only {human_bytes(free)} is available; lower num_blocks, kv_cache_memory_gib "
            "or max_model_len"
        )
    return num_blocks


def zeroed_host_tensors(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed host tensors of ``shapes`` in one anonymous memory mapping: the
    kernel hands its pages out zeroed as they are first touched, so a KV
    cache sized for many sequences costs no time to clear and no memory
    until used (``torch.zeros`` writes every byte, in time proportional to
    the size)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
    mapping = mmap.mmap(-1, max(sum(sizes), 1))
    flat = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    tensors, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        tensors.append(flat[offset : offset + size].view(dtype).view(shape))
        offset += size
    return tensors


def _ffn_width(arch: ModelArchConfig) -> int:
    """A token's feed-forward activations' width: the dense MLP's, or its
    ``top_k`` experts' (each token's rows are copied once per expert)."""
    experts = arch.num_experts_per_tok * arch.moe_intermediate_size
    return max(arch.intermediate_size, experts)
