"""The memory a model will take, estimated from its config before anything is
allocated, and the memory a device has free.

:func:`check_model_fits` runs in ``load_model`` before the model's modules are
built: this rank's parameters (its layers and its ``1 / tp`` of each split
projection, in the load dtype), the rotary cos/sin cache (float32, peak while
it is built) and the largest tensor in flight while weights load. MoE
experts kept MXFP4 (gpt-oss on the CPU: ``mxfp4_experts``) count their
projections' values at 4.25 bits (:func:`~asyncstep.models.mxfp4.mxfp4_bytes`),
as held, the rest in the load dtype. A model that
needs more than the device has is refused with one line; so is, in the runner,
a KV cache larger than the memory left (:func:`check_fits`).

Free memory: on CUDA ``torch.cuda.mem_get_info``; on the CPU the kernel's
``MemAvailable`` (``/proc/meminfo``), lowered to the cgroup's limit less its
usage where one is set. Where neither can be read, nothing is refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncstep.errors import ModelLoadError
from asyncstep.models.config import ModelArchConfig, pp_layer_range

if TYPE_CHECKING:
    import torch

#: Live float32 copies of the largest tensor while a checkpoint loads (a GGUF
#: dequantization makes temporaries; a rank narrows a whole tensor to its
#: shard); random weights are drawn in place, one tensor at a time.
CHECKPOINT_LOADING_COPIES = 3
#: A rotary cache is built from its angles: float32 angles (half the width)
#: and the cache itself are alive at once.
ROTARY_BUILD_PEAK = 1.5

_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ModelMemory:
    """Bytes one rank of a model takes, by what takes them."""

    weights: int
    rotary: int
    loading: int


def rank_param_count(
    arch: ModelArchConfig,
    *,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_size: int = 1,
) -> int:
    """Parameters one TP x PP rank of ``arch`` holds, as ``LlamaForCausalLM``
    builds them (``ep_size`` > 1: expert parallelism, each rank holding
    ``1 / ep_size`` of the experts whole)."""
    h, d = arch.hidden_size, arch.head_dim
    heads = -(-arch.num_attention_heads // tp_size)
    kv_heads = -(-arch.num_key_value_heads // tp_size)
    inter = -(-arch.intermediate_size // tp_size)
    vocab = -(-arch.vocab_size // tp_size)
    qkv_rows = (heads + 2 * kv_heads) * d
    norms = 4 if arch.is_gemma else 2  # Gemma's sandwich: two more per layer
    layer = norms * h + qkv_rows * h + h * heads * d
    layer += qkv_rows if arch.attention_bias else 0
    if arch.qk_norm:
        layer += sum(arch.qk_norm_widths)
    # A MoE layer: the router, and every expert's 1 / tp of its projections
    # (under EP: 1 / ep of the experts, whole).
    expert_inter = -(-arch.moe_intermediate_size // (tp_size if ep_size == 1 else 1))
    local_experts = arch.num_experts // ep_size
    experts = arch.num_experts * h + local_experts * 3 * expert_inter * h
    if arch.family == "gpt_oss":  # o bias, sinks; router and expert biases
        layer += h + heads
        experts += arch.num_experts + local_experts * (2 * expert_inter + h)
    start, end = pp_layer_range(arch.num_hidden_layers, pp_rank, pp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    count = (end - start) * layer
    count += sum(experts if arch.is_moe_layer(i) else 3 * inter * h for i in range(start, end))
    count += vocab * h if first else 0
    if last:
        count += h + (0 if arch.tie_word_embeddings and first else vocab * h)
    return count


def rank_expert_values(
    arch: ModelArchConfig, *, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1
) -> int:
    """The expert projections' values one rank holds (no expert
    parallelism): every expert's ``1 / tp`` of gate, up and down, each MoE
    layer of its stage."""
    inter = -(-arch.moe_intermediate_size // tp_size)
    start, end = pp_layer_range(arch.num_hidden_layers, pp_rank, pp_size)
    layers = sum(1 for i in range(start, end) if arch.is_moe_layer(i))
    return layers * arch.num_experts * 3 * inter * arch.hidden_size


def model_memory(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    *,
    random_weights: bool = False,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_size: int = 1,
    mxfp4_experts: bool = False,
) -> ModelMemory:
    """What one rank of ``arch`` takes while it loads and after (see the
    module doc; ``mxfp4_experts``: the experts held MXFP4, no expert
    parallelism)."""
    params = rank_param_count(
        arch, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, ep_size=ep_size
    )
    packed = 0
    if mxfp4_experts:
        from asyncstep.models.mxfp4 import mxfp4_bytes  # imports torch: the front end's does not

        values = rank_expert_values(arch, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
        params, packed = params - values, mxfp4_bytes(values)
    gate_up = 2 if arch.family == "gpt_oss" else 1
    largest = max(
        arch.vocab_size * arch.hidden_size,
        arch.intermediate_size * arch.hidden_size,
        # A GGUF's experts are stacked in one tensor, dequantized whole;
        # gpt-oss's gate and up are one tensor (a GGUF's two stacks, paired).
        arch.num_experts * arch.moe_intermediate_size * arch.hidden_size * gate_up,
        arch.q_size * arch.hidden_size,
    )
    # Gemma 3's sliding layers have a rotary of their own.
    rotaries = 2 if arch.is_gemma else 1
    rotary = arch.max_position_embeddings * arch.head_dim * 4 * rotaries
    return ModelMemory(
        weights=params * dtype.itemsize + packed,
        rotary=int(rotary * ROTARY_BUILD_PEAK),
        loading=largest * 4 * (1 if random_weights else CHECKPOINT_LOADING_COPIES),
    )


def available_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` now, or None where that cannot be told."""
    if device.type == "cuda":
        import torch  # a CUDA device: torch is loaded already

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return available_host_memory()
    return None


def available_host_memory() -> int | None:
    """The host's ``MemAvailable``, lowered to what this process's cgroup has left."""
    found = [n for n in (_meminfo_available(), _cgroup_available()) if n is not None]
    return min(found) if found else None


def check_fits(needed: int, device: torch.device, what: str) -> None:
    """Raise a one-line ModelLoadError if ``needed`` bytes exceed ``device``'s free memory."""
    _refuse_over(needed, available_memory(device), str(device), what)


def check_host_fits(needed: int, what: str) -> None:
    """:func:`check_fits` on the host (no torch needed)."""
    _refuse_over(needed, available_host_memory(), "cpu", what)


def _refuse_over(needed: int, free: int | None, where: str, what: str) -> None:
    if free is not None and needed > free:
        raise ModelLoadError(
            f"{what} needs {human_bytes(needed)} on {where} but only "
            f"{human_bytes(free)} is available"
        )


def check_model_fits(
    arch: ModelArchConfig,
    dtype: torch.dtype,
    device: torch.device,
    *,
    source: str,
    random_weights: bool,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_size: int = 1,
    mxfp4_experts: bool = False,
) -> None:
    """Refuse a model this rank cannot hold, before any of it is built.

    The tensors in flight while loading live on ``device`` for random weights
    (drawn there), else on the host (checkpoint tensors are read there).
    """
    need = model_memory(
        arch,
        dtype,
        random_weights=random_weights,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        ep_size=ep_size,
        mxfp4_experts=mxfp4_experts,
    )
    on_device = need.weights + need.rotary
    on_host = need.loading
    if random_weights or device.type == "cpu":
        on_device, on_host = on_device + need.loading, 0
    kind = str(dtype).removeprefix("torch.") + (" and MXFP4" if mxfp4_experts else "")
    detail = (
        f"{human_bytes(need.weights)} of {kind} weights, "
        f"{human_bytes(need.rotary)} of rotary cache, {human_bytes(need.loading)} to load a tensor"
    )
    check_fits(on_device, device, f"{source}: the model ({detail})")
    if on_host:
        check_host_fits(on_host, f"{source}: loading the model's tensors")


def human_bytes(n: int) -> str:
    """``n`` bytes in MiB below a GiB, else in GiB."""
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    return None


def _cgroup_available() -> int | None:
    """What this process's memory cgroup has left: its limit (the lowest of its
    own and its ancestors') less its usage, page cache it could drop not counted."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    if v1 is not None:  # a hybrid system's unified hierarchy holds no memory controller
        return _cgroup_v1_available(_CGROUP_ROOT / "memory", v1)
    return None if v2 is None else _cgroup_v2_available(_CGROUP_ROOT, v2)


def _cgroup_dir(root: Path, path: str) -> Path:
    directory = root / path.lstrip("/")
    return directory if directory.is_dir() else root  # a cgroup namespace: its root


def _cgroup_v2_available(root: Path, path: str) -> int | None:
    directory = _cgroup_dir(root, path)
    left: list[int] = []
    for level in (directory, *directory.parents):
        if not level.is_relative_to(root):
            break
        limit = _read_int(level / "memory.max")
        usage = _read_int(level / "memory.current")
        if limit is not None and usage is not None:
            left.append(limit - usage + _stat(level / "memory.stat", "inactive_file"))
    return max(min(left), 0) if left else None


def _cgroup_v1_available(root: Path, path: str) -> int | None:
    directory = _cgroup_dir(root, path)
    limit = _stat(directory / "memory.stat", "hierarchical_memory_limit")
    usage = _read_int(directory / "memory.usage_in_bytes")
    if not limit or usage is None:
        return None
    return max(limit - usage + _stat(directory / "memory.stat", "total_inactive_file"), 0)


def _read_int(path: Path) -> int | None:
    """A file holding one integer; None if absent, unreadable or "max"."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _stat(path: Path, key: str) -> int:
    """One value of a cgroup ``memory.stat`` file (0 if absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
