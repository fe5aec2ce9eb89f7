"""A rank's model runner and its KV cache size, from the engine's whole
:class:`~asyncstep.config.EngineConfig` (the same in the engine's process and
in every rank process)."""

from __future__ import annotations

import msgspec
import torch

from asyncstep.config import EngineConfig
from asyncstep.errors import ConfigError
from asyncstep.models.llama import LlamaForCausalLM
from asyncstep.models.model_loader import LoadedModel, cpu_threads, load_model
from asyncstep.runner.cpu_threads import CpuThreads
from asyncstep.runner.kv_sizing import num_kv_blocks
from asyncstep.runner.model_runner import ModelRunner


def resolved_max_model_len(config: EngineConfig) -> int:
    """``config.model.max_model_len``, which the engine resolves from the
    model before it builds a runner; ConfigError while it is still None."""
    max_model_len = config.model.max_model_len
    if max_model_len is None:
        raise ConfigError("max_model_len must be resolved from the model before a runner is built")
    return max_model_len


def build_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    """The runner of ``loaded`` as ``config`` says; its KV cache not allocated
    yet. On the CPU, torch's threads become
    :func:`~asyncstep.models.model_loader.cpu_threads`' (every thread takes
    that count on its first torch op)."""
    spec = config.speculative_config
    draft = None
    if spec is not None and spec.method == "draft_model":
        draft = load_draft_model(config, loaded)
    threads = None
    if loaded.device.type == "cpu":
        threads = CpuThreads(cpu_threads(config.parallel))
        torch.set_num_threads(threads.threads)
    return ModelRunner(
        loaded.model,
        device=loaded.device,
        dtype=loaded.dtype,
        max_model_len=resolved_max_model_len(config),
        max_num_reqs=config.scheduler.max_num_seqs,
        block_size=config.cache.block_size,
        async_scheduling=config.uses_output_placeholders,
        compilation=config.compilation,
        max_num_batched_tokens=config.max_num_batched_tokens,
        graph_stand_in=config.compilation.cudagraph_stand_in,
        num_input_batches=config.num_input_batches,
        cpu_threads=threads,
        draft_model=draft,
        speculative_config=spec,
        batch_invariant=config.model.batch_invariant,
    )


def load_draft_model(config: EngineConfig, target: LoadedModel) -> LlamaForCausalLM:
    """``speculative_config``'s draft model, loaded as the target was (its
    device, dtype, load format and packing) for the target's context; a
    ConfigError unless its vocabulary is the target's size."""
    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    draft_config = msgspec.structs.replace(
        config.model,
        model=spec.model,
        max_model_len=resolved_max_model_len(config),
        chat_template=None,
    )
    draft = load_model(draft_config, with_tokenizer=False)
    vocab, target_vocab = draft.arch_config.vocab_size, target.arch_config.vocab_size
    if vocab != target_vocab:
        raise ConfigError(
            f"the draft model's vocabulary has {vocab} tokens, the target's {target_vocab}: "
            "a draft model must share the target's tokenizer"
        )
    return draft.model


def kv_cache_blocks(config: EngineConfig, runner: ModelRunner, loaded: LoadedModel) -> int:
    """KV blocks this rank holds: ``config.cache.num_blocks``, else what its
    memory allows (see :func:`~asyncstep.runner.kv_sizing.num_kv_blocks`)."""
    return num_kv_blocks(
        config.cache,
        block_bytes=runner.kv_cache_block_bytes(),
        max_model_len=resolved_max_model_len(config),
        max_num_running_reqs=config.max_num_running_reqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        arch=loaded.arch_config,
        device=loaded.device,
        dtype=loaded.dtype,
        num_kv_cache_groups=runner.kv_binding.num_groups,
    )
