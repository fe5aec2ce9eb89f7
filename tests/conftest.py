"""Shared fixtures: models are loaded once per session and reused.

``ASYNCSTEP_TEST_DEVICE=cuda`` runs the device-aware tests (runner, attention,
engine, HF parity on tiny checkpoints) on the GPU instead of the CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Triton kernels run interpreted on the CPU; the variable must be set before
# triton is first imported.
if os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, load_model

# Under pytest-xdist (the README's `-n 2`) the workers share the cores:
# each gets its share of torch's threads, not all of them (OpenMP threads
# that outnumber the cores spin against each other).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


TEST_DEVICE = os.environ.get("ASYNCSTEP_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the device-aware tests run on (fp32 there too)."""
    return torch.device(TEST_DEVICE)


@pytest.fixture(scope="session")
def tiny_model(device: torch.device) -> LoadedModel:
    """A tiny random Llama (dummy weights, no tokenizer), in fp32."""
    return load_model(
        ModelConfig(model="tiny-llama", load_format="dummy", device=str(device), dtype="float32")
    )


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct (GGUF), on the CPU in fp32, dense
    weights only (the HF-parity reference; packed weights: tests/models/test_packed.py)."""
    return load_model(ModelConfig(device="cpu", dtype="float32", weight_packing="none"))


@pytest.fixture(scope="session")
def smollm2_default() -> LoadedModel:
    """The embedded model as a user gets it: dtype auto, its 4-bit weights
    in the CPU library's blocks where they run (float32 activations)."""
    return load_model(ModelConfig(device="cpu"))


@pytest.fixture(scope="session")
def smollm2_bf16() -> LoadedModel:
    """The embedded model with bfloat16 asked for (packed as by default):
    bfloat16 activations run on every CPU, AVX2 too (slower), so a machine
    without AVX512-BF16 tests that path as well."""
    return load_model(ModelConfig(device="cpu", dtype="bfloat16"))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2: LoadedModel) -> Any:
    """transformers' Llama on the same weights (the GGUF's, dequantized; the
    loader tests prove they equal transformers' own GGUF loading)."""
    from asyncstep.models.hf_reference import hf_reference_model

    return hf_reference_model(None, pad_token_id=2)


@pytest.fixture(scope="session")
def avx2_kernels_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel cache for the whole library built as for an AVX2-only CPU
    (``ASYNCSTEP_CPU_KERNELS_ISA=avx2``), shared by the tests that load that
    build: built once a run (the build is a rename of a finished file, so
    xdist's workers share it too), not once a test."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = shared / "avx2-kernels"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama checkpoint (safetensors) with SmolLM2's tokenizer and
    chat template: loads in a second, makes text (of no meaning)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncstep.models.loader import open_checkpoint

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=2,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-hf")
    LlamaForCausalLM(config).save_pretrained(path)
    open_checkpoint(None).load_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def peaked_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny Llama with large random weights, saved as an HF checkpoint, and
    HF's model of it: its logits are far from ties, so fp32 reduction-order
    differences (layouts, chunks) cannot flip a token."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("peaked-llama")
    model.save_pretrained(path)
    return path, model
