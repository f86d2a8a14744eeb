"""Shared fixtures: tiny random checkpoints of each supported family, as transformers models
and as minivllm models loaded from them."""
from __future__ import annotations

import pytest
import torch

import minivllm
from tiny_models import CONFIGS, hf_greedy, tiny_hf_model

torch.set_num_threads(1)  # tiny models gain nothing from a second thread; a shared machine loses a lot


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def hf_models() -> dict:
    return {name: tiny_hf_model(name) for name in CONFIGS}


@pytest.fixture(scope="session")
def hf_model(hf_models, family):
    return hf_models[family]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, hf_models):
    """The tiny Qwen3 model saved as a checkpoint folder, for scripts that take --model."""
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    hf_models["qwen3"].save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model(hf_model):
    """minivllm's Decoder with the same weights as `hf_model` (fp32, CPU)."""
    return minivllm.load_model(hf_model, device="cpu")


@pytest.fixture(scope="session")
def qwen3_model(hf_models):
    """minivllm's Decoder of the tiny Qwen3 model alone: for checks about the engine, which do
    not depend on the model family."""
    return minivllm.load_model(hf_models["qwen3"], device="cpu")


@pytest.fixture(scope="session")
def reference():
    """Greedy continuations from transformers, cached: reference(hf_model, prompt, n)."""
    cache: dict = {}

    def get(hf_model, prompt: list[int], n: int) -> list[int]:
        key = (id(hf_model), tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf_model, prompt, n)
        return cache[key]

    return get
