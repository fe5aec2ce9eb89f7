"""The HF-parity scaffolding the model-family tests share: a tiny random
model made with transformers, saved with ``save_pretrained`` (safetensors)
or converted to a GGUF as llama.cpp's converter writes it; transformers'
greedy tokens for a set of prompts; ours from an engine (fp32, CPU, the
prompts submitted at once), to compare token for token::

    PARITY = Parity(PROMPTS)                       # 32 tokens a prompt
    model = random_model(transformers.MistralConfig(**tiny_fields(...)))
    path, expected = PARITY.save(model, tmp_path)  # the checkpoint, HF's tokens
    assert PARITY.serve(path, tensor_parallel_size=2) == expected

``tiny_fields`` holds the config fields the tiny models share (a vocabulary
of 256, 64 hidden, 4 heads over 2 KV heads, no EOS: every prompt generates
its whole budget; weights larger than transformers' default, so the logits
are far from ties). The family tests keep what is theirs (their configs,
the perturbations that make a field matter, the layouts)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import trio

import asyncstep
from asyncstep import SamplingParams
from asyncstep.models.model_loader import LoadedModel
from tests.models.test_loaders import HF_TO_GGUF_BLOCK, HF_TO_GGUF_GLOBAL, llama_cpp_permute

MAX_TOKENS = 32
#: Prompts of different lengths (one of a token).
PROMPTS = [[3, 17, 92, 5], [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31], [77]]
#: Prompts all longer than a window of 8 tokens.
LONG_PROMPTS = [
    [3, 17, 92, 5, 250, 7, 7, 41, 99, 123, 8],
    [250, 7, 7, 41, 99, 123, 8, 64, 12, 200, 31, 18, 77, 140, 3, 9, 21, 60, 2, 33],
    [77, 5, 9, 200, 14, 14, 150, 61, 8],
]

#: A checkpoint's path and transformers' greedy tokens of each prompt.
Checkpoint = tuple[Path, list[list[int]]]


def tiny_fields(**changes: Any) -> dict[str, Any]:
    """The fields of a tiny random config, ``changes`` applied."""
    fields: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        # Larger weights than the default make the logits far from ties.
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    return fields | changes


def random_model(config: Any, *, seed: int = 0, **options: Any) -> Any:
    """transformers' model of ``config``, random (seeded), in eval mode;
    ``options`` go to ``from_config`` (``attn_implementation``)."""
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, **options).eval()


def hf_greedy(model: Any, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """transformers' greedy tokens after ``prompt``: ``max_tokens`` of them."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
        )
    return list(out[0, len(prompt) :].tolist())


@dataclass(frozen=True)
class Parity:
    """Prompts and a token budget: transformers' greedy tokens and ours."""

    prompts: list[list[int]]
    max_tokens: int = MAX_TOKENS

    def expected(self, model: Any) -> list[list[int]]:
        """transformers' greedy tokens of each prompt."""
        return [hf_greedy(model, p, self.max_tokens) for p in self.prompts]

    def save(self, model: Any, path: Path) -> Checkpoint:
        """``model`` saved to ``path`` (safetensors) and its greedy tokens."""
        model.save_pretrained(path, safe_serialization=True)
        return path, self.expected(model)

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)

    async def generate_all(self, engine: Any) -> list[list[int]]:
        """Every prompt's tokens from ``engine``, the prompts submitted at once."""
        results: list[list[int]] = [[] for _ in self.prompts]

        async def one(i: int) -> None:
            results[i] = (await engine.generate(self.prompts[i], self.params)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(self.prompts)):
                nursery.start_soon(one, i)
        return results

    async def serve_async(self, model: Path | LoadedModel, **options: Any) -> list[list[int]]:
        """Our greedy tokens from an engine of ``model`` (fp32 on the CPU, the
        engine core in this process unless ``options`` say otherwise)."""
        options = {"device": "cpu", "dtype": "float32", "engine_process": False} | options
        async with asyncstep.open_engine(model, **options) as engine:
            return await self.generate_all(engine)

    def serve(self, model: Path | LoadedModel, **options: Any) -> list[list[int]]:
        """:meth:`serve_async` under its own ``trio.run``."""
        return trio.run(lambda: self.serve_async(model, **options))


# -- GGUF ---------------------------------------------------------------------

#: A MoE block's tensors: the router, and each expert's projection -> its stack.
_GGUF_ROUTER = {"mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}
_GGUF_STACKS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}


def write_hf_gguf(
    path: Path,
    hf_dir: Path,
    gguf_arch: str,
    *,
    stacked: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """``hf_dir``'s checkpoint as llama.cpp's converter writes it: float32,
    q/k rows permuted for the ``llama`` architecture, each expert
    projection's experts stacked ``[experts, ...]`` (the first ``stacked``
    only, where given), ``sliding_window`` in the metadata where given."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    state = {k: v.numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if "moe_intermediate_size" in config:
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    stacks: dict[str, list[Any]] = {}
    for name, value in state.items():
        module, kind = name.rsplit(".", 1)
        if module in HF_TO_GGUF_GLOBAL:
            writer.add_tensor(f"{HF_TO_GGUF_GLOBAL[module]}.{kind}", value)
            continue
        _, _, layer, rest = module.split(".", 3)
        if ".experts." in rest:
            _, _, expert, proj = rest.split(".")
            stack = f"blk.{layer}.ffn_{_GGUF_STACKS.get(proj, 'down')}_exps.weight"
            stacks.setdefault(stack, [None] * experts)[int(expert)] = value
            continue
        if gguf_arch == "llama" and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        gguf_module = _GGUF_ROUTER.get(rest) or HF_TO_GGUF_BLOCK[rest]
        writer.add_tensor(f"blk.{layer}.{gguf_module}.{kind}", value)
    for name, values in stacks.items():
        writer.add_tensor(name, np.stack(values[:stacked]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- a MoE block, op by op -----------------------------------------------------


def moe_block_differences(path: Path, rows: int = 13) -> list[float]:
    """Each MoE layer's largest difference between our block (router and
    experts, loaded from ``path``) and transformers' (the same checkpoint),
    on the same random rows in fp32, relative to transformers' largest
    output; dense layers are passed over."""
    import transformers

    from asyncstep.config import ModelConfig
    from asyncstep.models.layers.moe import SparseMoeBlock
    from asyncstep.models.model_loader import load_model

    ours = load_model(ModelConfig(model=str(path), device="cpu", dtype="float32")).model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.randn(rows, theirs.config.hidden_size, generator=torch.Generator().manual_seed(0))
    differences = []
    with torch.inference_mode():
        for our_layer, their_layer in zip(ours.model.layers, theirs.model.layers, strict=True):
            if not isinstance(our_layer.mlp, SparseMoeBlock):
                continue
            want = their_layer.mlp(x[None])
            want = want[0] if isinstance(want, tuple) else want  # gpt-oss's: (rows, scores)
            error = (our_layer.mlp(x) - want[0]).abs().max() / want.abs().max()
            differences.append(float(error))
    return differences
