"""Shared fixtures: models are loaded once per session and reused."""

from __future__ import annotations

import pytest
import torch

from asyncstep.config import ModelConfig
from asyncstep.models.model_loader import LoadedModel, load_model


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    """A tiny random Llama (dummy weights, no tokenizer), on the CPU in fp32."""
    return load_model(ModelConfig("tiny-llama", load_format="dummy", device="cpu"))
