"""Build a model on a device and fill its weights: from a checkpoint (GGUF
file or HF directory) or at random (``load_format="dummy"``).

Nothing is allocated from a model's declared sizes before they are checked:
the checkpoint's config is validated and bounded and its tensors' shapes,
offsets and dtypes checked against it when it opens, and the memory this rank
will take is estimated and refused when the device lacks it
(:func:`~asyncstep.models.memory.check_model_fits`), all before the modules
are built or the tokenizer converted."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncstep.channels import get_ep_group, get_pp_group, get_tp_group
from asyncstep.config import ModelConfig, ParallelConfig
from asyncstep.cpu_features import cpu_has_bf16, cpu_has_quant_vectors
from asyncstep.errors import ConfigError, ModelLoadError
from asyncstep.logging import get_logger, notice, shown_path
from asyncstep.logging.spans import CORE_STARTUP, now_us, record_startup, span
from asyncstep.models.config import ModelArchConfig
from asyncstep.models.dense_weights import EVERY_STEP, drop_dense_weights
from asyncstep.models.dummy import SHAPES, dummy_weights, get_shape
from asyncstep.models.gpt_oss import keeps_mxfp4_experts
from asyncstep.models.layers.embedding import ParallelLMHead
from asyncstep.models.layers.gpu_quant import packing_on_load, round_decoder_weights
from asyncstep.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from asyncstep.models.layers.norm import RMSNorm
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.models.loader import Checkpoint, open_checkpoint
from asyncstep.models.memory import check_model_fits
from asyncstep.models.model_info import maybe_tokenizer, resolve_max_model_len
from asyncstep.models.registry import model_class
from asyncstep.models.weight_cache import PackedCache
from asyncstep.ops.packed import (
    PackedWeight,
    is_int8_blocks,
    pack_int4,
    pack_int8_rows,
)
from asyncstep.ops.weights import cpu_kernels_off, pack_cpu_blocks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = get_logger("models")

#: Called as weights load: (tensors done, tensors in all).
ProgressFn = Callable[[int, int], None]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch_config: ModelArchConfig
    tokenizer: PreTrainedTokenizerBase | None
    device: torch.device
    dtype: torch.dtype
    #: Longest sequence this engine serves.
    max_model_len: int
    #: What was loaded: a path, or a shape name for dummy weights.
    source: str
    _in_use: bool = False

    @contextmanager
    def claim(self) -> Iterator[None]:
        """Held by the engine that runs this model: one engine at a time (the
        attention layers are bound to that engine's KV cache)."""
        if self._in_use:
            raise ConfigError("this loaded model is already serving another engine")
        self._in_use = True
        try:
            yield
        finally:
            self._in_use = False


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but torch sees no CUDA device")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device, *, cpu_blocks_fit: bool = False) -> torch.dtype:
    """``auto``: bfloat16 on CUDA. On the CPU: float32 where the decoder's
    weights stay in the CPU library's blocks (``cpu_blocks_fit``: exact
    weights, whose matmul takes float32 rows at the speed of bfloat16 ones, so
    the activations keep float32's precision and greedy tokens stay those of
    a float32 reference), else bfloat16 on CPUs that multiply it natively
    (AVX512-BF16 or AMX, as vLLM's CPU backend decides), float32 elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_bf16() and not cpu_blocks_fit else torch.float32
    return _DTYPES[name]


def cpu_blocks_fit(
    config: ModelConfig, checkpoint: Checkpoint | None, device: torch.device
) -> bool:
    """Whether every decoder projection of ``config``'s model will be kept in
    the CPU library's blocks: on the CPU where they run, packing not switched
    off, and 4-bit weights (a GGUF's Q4_0 / Q4_1, or any rounded by
    ``weight_packing="q4"``); never a mixture-of-experts model's (its
    experts stay dense)."""
    if device.type != "cpu" or config.weight_packing == "none" or not cpu_blocks():
        return False
    arch_config = getattr(checkpoint, "arch_config", None)
    if arch_config is not None and arch_config().is_moe:
        return False
    if config.weight_packing == "q4":
        return True
    four_bit = getattr(checkpoint, "decoder_weights_4bit", None)
    return config.load_format != "dummy" and four_bit is not None and bool(four_bit())


def cpu_threads(parallel: ParallelConfig) -> int:
    """Torch threads of one rank's forward on the CPU: ``parallel.cpu_threads``,
    or the cores this process may use divided among the ranks started on
    this machine (every data-parallel replica's), less one core for the
    front end where there are more than four (on fewer, the forward needs
    them more than the front end does)."""
    if parallel.cpu_threads is not None:
        return parallel.cpu_threads
    cores = len(os.sched_getaffinity(0))
    if cores > 4:
        cores -= 1
    ranks = parallel.world_size if parallel.launch_ranks else 1
    ranks *= parallel.data_parallel_size
    return max(1, cores // ranks)


def load_model(
    config: ModelConfig,
    progress: ProgressFn | None = None,
    *,
    sequence_parallel: bool = False,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Build the model described by ``config`` on its device, weights loaded
    (``sequence_parallel``: see :class:`~asyncstep.config.ParallelConfig`)."""
    device = resolve_device(config.device)
    checkpoint: Checkpoint | None = None
    if config.load_format == "dummy" and (config.model is None or str(config.model) in SHAPES):
        source = str(config.model or "smollm2-135m")
        arch = get_shape(source)
    else:
        # Its sizes checked against its tensors (dummy: its config only).
        checkpoint = open_checkpoint(config.model, config.load_format)
        arch = checkpoint.arch_config()
        source = str(checkpoint.path)
    weights = None if config.load_format == "dummy" else checkpoint
    dtype = resolve_dtype(
        config.dtype, device, cpu_blocks_fit=cpu_blocks_fit(config, checkpoint, device)
    )
    arch.validate()
    if arch.is_moe and config.weight_packing == "q4":
        raise ConfigError(
            f"weight_packing q4 does not apply to {arch.architecture}: its experts stay dense"
        )
    max_model_len = resolve_max_model_len(config.max_model_len, arch)
    tp, pp = get_tp_group(), get_pp_group()
    # On the CPU the weights load in float32 (as the checkpoint gives them:
    # packing reads them so), then take their dtypes: the float32 build is the peak.
    build_dtype = torch.float32 if device.type == "cpu" else dtype
    check_model_fits(
        arch,
        build_dtype,
        device,
        source=source,
        random_weights=weights is None,
        tp_size=tp.world_size,
        pp_rank=pp.rank_in_group,
        pp_size=pp.world_size,
        ep_size=get_ep_group().world_size,
        mxfp4_experts=keeps_mxfp4_experts(
            arch, dtype, device, tp.world_size, get_ep_group().world_size
        ),
    )
    tokenizer = maybe_tokenizer(checkpoint) if checkpoint is not None and with_tokenizer else None
    packs_cpu = weights is not None or config.weight_packing == "q4"
    packs_cpu = packs_cpu and device.type == "cpu" and config.weight_packing != "none"
    packs_cpu = packs_cpu and packs_cpu_dtype(dtype, explicit=config.dtype != "auto")
    packs_cpu = packs_cpu and not arch.is_moe  # dense experts: no packing, no packed cache
    cache = None
    if packs_cpu and weights is not None and config.packed_weight_cache:
        options = _cache_options(config, dtype, sequence_parallel)
        cache = PackedCache.for_checkpoint(weights.path, options)
        cached = _load_packed_cache(cache, arch, dtype, sequence_parallel) if cache else None
        if cached is not None:
            return _loaded(
                LoadedModel(cached, arch, tokenizer, device, dtype, max_model_len, source)
            )
        if cache is not None:
            where = shown_path(cache.path.parent)
            notice(f"packing the weights for this CPU (once, cached in {where})")
    with torch.device(device):
        model = model_class(arch)(arch, build_dtype, sequence_parallel=sequence_parallel)
    if weights is None:
        total = len(needed := model.expected_weight_names())
        tensors = dummy_weights(arch, seed=config.seed, device=device, names=needed)
    else:
        total = len(weights.weight_names())
        tensors = weights.iter_weights()
    if config.weight_packing == "q4":
        # On CUDA the LM head too, onto Q8_0's grid (a GGUF Q4 model's is 6 or 8 bits).
        tensors = round_decoder_weights(tensors, lm_head=device.type == "cuda")
    read_since = now_us()
    if device.type == "cuda" and config.weight_packing != "none":
        tied = model.model.embed_tokens.weight if model.model.embed_tokens is not None else None
        with packing_on_load(model, tied=tied) as counts:
            _load_checkpoint(model, _counted(tensors, total, progress))
        log.info("weights kept 4-bit on the GPU", **counts)
    else:
        _load_checkpoint(model, _counted(tensors, total, progress))
    record_startup("read_weights", read_since, task=CORE_STARTUP)
    if packs_cpu:
        with span("pack_weights", CORE_STARTUP):
            packed = pack_weights(model, dtype, config.packed_max_tokens)
        log.info("weights packed for the CPU", **packed)
    if build_dtype != dtype:
        settle_dtype(model, dtype)
    model.eval()
    if device.type == "cpu":
        return_freed_memory()
    if cache is not None:
        with span("packed_cache_store", CORE_STARTUP):
            cache.store(model)
    return _loaded(LoadedModel(model, arch, tokenizer, device, dtype, max_model_len, source))


def _loaded(loaded: LoadedModel) -> LoadedModel:
    """``loaded``, logged (``-v``: which model, where, in which dtype)."""
    arch = loaded.arch_config
    log.info(
        "model loaded",
        source=loaded.source,
        device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        layers=arch.num_hidden_layers,
        hidden=arch.hidden_size,
        max_model_len=loaded.max_model_len,
    )
    return loaded


def _load_packed_cache(
    cache: PackedCache, arch: ModelArchConfig, dtype: torch.dtype, sequence_parallel: bool
) -> LlamaForCausalLM | None:
    """The CPU model of ``cache``'s entry, or None where it has none."""
    since = now_us()
    with torch.device("cpu"):
        model = model_class(arch)(arch, dtype, sequence_parallel=sequence_parallel)
    settle_dtype(model, dtype)
    if not cache.load(model, dtype):
        return None
    record_startup("packed_cache", since, task=CORE_STARTUP)
    log.info("weights from the packed cache", path=str(cache.path))
    return model.eval()


def _cache_options(
    config: ModelConfig, dtype: torch.dtype, sequence_parallel: bool
) -> dict[str, object]:
    """What a packed model depends on beside its checkpoint and the code
    (:class:`~asyncstep.models.weight_cache.PackedCache`'s key)."""
    tp, pp = get_tp_group(), get_pp_group()
    return {
        "dtype": str(dtype),
        "load_format": config.load_format,
        "weight_packing": config.weight_packing,
        "packed_max_tokens": config.packed_max_tokens,
        "cpu_blocks": cpu_blocks(),
        "rank": [tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size],
        "sequence_parallel": sequence_parallel,
    }


def return_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc keeps what the load's
    temporaries freed, e.g. the packing's); a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)


def cpu_blocks() -> bool:
    """Whether CPU packing takes the library's blocks (its vector build runs
    here and is not switched off), else torch's int4 / int8."""
    return cpu_has_quant_vectors() and not cpu_kernels_off()


def packs_cpu_dtype(dtype: torch.dtype, *, explicit: bool) -> bool:
    """Whether a CPU model of ``dtype`` packs its weights: a bfloat16 one
    always; a float32 one where the library's blocks run and float32 is the
    machine's default (``dtype`` auto), not asked for (full precision)."""
    # torch's packed matmuls are fast with bfloat16 rows only (one row of
    # SmolLM2's gate_up in float32: int4 1.7 ms against 0.15 ms dense).
    return dtype == torch.bfloat16 or (dtype == torch.float32 and not explicit and cpu_blocks())


def settle_dtype(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Cast a float32-built CPU model's parameters to ``dtype``, but for the
    norms, which keep float32 weights and a float32 residual stream
    (:class:`~asyncstep.models.layers.norm.RMSNorm`'s ``float32_residual``)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.float32_residual = True
        target = torch.float32 if isinstance(module, RMSNorm) else dtype
        for param in module.parameters(recurse=False):
            param.data = param.data.to(target)


def pack_weights(
    model: LlamaForCausalLM, dtype: torch.dtype, max_tokens: int | None = None
) -> dict[str, int]:
    """Give each linear layer whose float32 weight is exactly 4-bit a packed
    copy, and an 8-bit LM head one too, for steps of at most ``max_tokens``
    tokens: the CPU library's Q4 / Q8 blocks where its vector build runs (AVX512-VNNI or AVX2)
    (:func:`~asyncstep.ops.weights.pack_cpu_blocks`), else torch's int4 / int8
    (:mod:`~asyncstep.ops.packed`, scales in ``dtype``). Returns
    how many of each kind, and their bytes. ``max_tokens`` None: every step
    with the library's blocks (one kernel for every step's size, so a
    request's greedy tokens do not depend on its neighbours), 8 with torch's
    (where they stop paying against the dense weights:
    ``benchmarks/studies/cpu_kernels/README.md``). A projection whose copy
    takes every step drops its dense weight as it is packed
    (:mod:`~asyncstep.models.dense_weights`; ``dropped_bytes``)."""
    counts = {"dense": 0, "bytes": 0, "dropped_bytes": 0}
    # Decided from the CPU's flags: the library itself is built (once per
    # machine, seconds) when a step first needs it, not while loading.
    blocks = cpu_blocks()
    if max_tokens is None:
        max_tokens = EVERY_STEP if blocks else 8
    if max_tokens == 0:
        return counts
    for module in model.modules():
        packed: PackedWeight | None = None
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            weight = module.weight.data
            if blocks:
                packed = pack_cpu_blocks(weight, dtype, max_tokens, lm_head=False)
            else:
                packed = pack_int4(weight, dtype, max_tokens)
        elif isinstance(module, ParallelLMHead):
            weight = module.weight.data
            if blocks:
                packed = pack_cpu_blocks(weight, dtype, max_tokens, lm_head=True)
            elif is_int8_blocks(weight):
                packed = pack_int8_rows(weight, dtype, max_tokens)
        else:
            continue
        module.packed = packed
        kind = "dense" if packed is None else packed.kind
        counts[kind] = counts.get(kind, 0) + 1
        counts["bytes"] += 0 if packed is None else packed.nbytes
        counts["dropped_bytes"] += drop_dense_weights(module, dtype)
    return counts


def _counted(
    weights: Iterator[tuple[str, torch.Tensor]], total: int, progress: ProgressFn | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(weights, 1):
        yield item
        if progress is not None:
            progress(i, total)


def _load_checkpoint(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    loaded = model.load_weights(weights)
    missing = model.expected_weight_names() - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:3])
        raise ModelLoadError(f"checkpoint lacks {len(missing)} weights, e.g. {shown}")


def model_source(model: str | Path | None) -> str:
    return "embedded SmolLM2-135M-Instruct" if model is None else str(model)
