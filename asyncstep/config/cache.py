"""The KV cache section: :class:`CacheConfig`. Imports msgspec and
:mod:`asyncstep.errors` only.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncstep.config.utils import field_doc
from asyncstep.errors import ConfigError


class CacheConfig(msgspec.Struct, kw_only=True):
    """The paged KV cache: block size and how many blocks."""

    block_size: Annotated[int, field_doc("tokens per KV cache block (a power of two)")] = 16
    num_blocks: Annotated[
        int | None,
        field_doc(
            "KV cache blocks; none: as many as kv_cache_memory_gib (CPU) or "
            "gpu_memory_utilization (CUDA) allows"
        ),
    ] = None
    kv_cache_memory_gib: Annotated[float, field_doc("KV cache size on the CPU (GiB)")] = 1.0
    gpu_memory_utilization: Annotated[
        float, field_doc("fraction of the GPU's memory the rank may fill (weights + KV cache)")
    ] = 0.85
    enable_prefix_caching: Annotated[
        bool, field_doc("share the KV blocks of identical prompt prefixes between requests")
    ] = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(
                f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
