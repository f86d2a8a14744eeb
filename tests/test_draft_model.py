"""The draft model shipped in minivllm/draft_model, for speculative decoding (chapter 12).

A draft is only useful if it proposes tokens the target can check: same
vocabulary, same token ids, much cheaper to run. These checks hold the
checkpoint to that, and minivllm's loader to transformers on it.
"""

from __future__ import annotations

import inspect
import json.decoder
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minivllm
from minivllm import DEFAULT_MODEL, DRAFT_MODEL
from minivllm.stages.naive import CausalAttention

pytestmark = pytest.mark.floors

MAX_FILE_BYTES = 16 * 1024 * 1024  # keeps every file under common git-host limits
EXPECTED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "training_log.json"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROMPT = inspect.getsource(json.decoder)[:600]  # real code: the token mix the model actually sees


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DRAFT_MODEL)


@pytest.fixture(scope="module")
def draft():
    return AutoModelForCausalLM.from_pretrained(DRAFT_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def test_folder_holds_only_small_checkpoint_files():
    files = {p.name: p.stat().st_size for p in Path(DRAFT_MODEL).iterdir()}
    assert set(files) == EXPECTED_FILES
    assert max(files.values()) <= MAX_FILE_BYTES
    assert sum(files.values()) < 8 * 2**20  # a few MB: a fraction of the default model


@pytest.mark.parametrize("name", TOKENIZER_FILES)
def test_tokenizer_files_are_the_default_models(name):
    # Byte for byte: the same vocabulary, merges, special tokens and settings.
    assert (Path(DRAFT_MODEL) / name).read_bytes() == (Path(DEFAULT_MODEL) / name).read_bytes()


def test_same_vocabulary_and_eos_as_the_target(draft, target, tokenizer):
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(DEFAULT_MODEL).get_vocab()
    assert draft.config.vocab_size == target.config.vocab_size == len(tokenizer)
    assert draft.config.eos_token_id == target.config.eos_token_id == tokenizer.eos_token_id
    assert draft.generation_config.eos_token_id == tokenizer.eos_token_id
    assert draft.config.max_position_embeddings == target.config.max_position_embeddings


def test_draft_is_a_much_smaller_qwen3(draft, target):
    assert draft.config.model_type == "qwen3"
    assert draft.config.tie_word_embeddings
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 0.5e6 < n_draft < sum(p.numel() for p in target.parameters()) / 3


def minivllm_logits(model: minivllm.Decoder, ids: torch.Tensor) -> torch.Tensor:
    hidden = model(ids, torch.arange(len(ids)), CausalAttention(len(ids), model.device))
    return model.lm_head(hidden)


def test_minivllm_loads_it_like_transformers(draft, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids[0]
    with torch.no_grad():
        expected = draft(ids[None]).logits[0]
    model = minivllm.load_model(DRAFT_MODEL, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(minivllm_logits(model, ids), expected, atol=1e-4, rtol=1e-4)


def test_draft_often_agrees_with_the_target(draft, target, tokenizer):
    # The point of a draft: its greedy guess is often the target's greedy token. A
    # repeated pattern is where speculative decoding shines; an untrained draft scores ~0.
    names = ("width", "height", "color", "style", "title")
    prompt = "".join(f"    def get_{name}(self):\n        return self._{name}\n\n" for name in names)
    prompt += "    def get_size(self):"  # not a bare newline: BPE merges it with the next indentation
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        full = target.generate(ids, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids))
        span = slice(ids.shape[1] - 1, full.shape[1] - 1)
        agree = draft(full).logits[0, span].argmax(-1) == target(full).logits[0, span].argmax(-1)
    assert agree.float().mean() > 0.5, agree.tolist()
