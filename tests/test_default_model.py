"""The tiny trained model shipped in minivllm/default_model.

These checks use only transformers, so they hold the checkpoint itself to
account; the package's own loader is compared with transformers elsewhere.
"""

from __future__ import annotations

import inspect
import runpy
import json.decoder
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minivllm import DEFAULT_MODEL

pytestmark = pytest.mark.floors

# A maintainer's tool, not part of the library: loaded from its file.
measure = runpy.run_path(str(Path(__file__).parents[1] / "tools" / "bits_per_byte.py"))["measure"]

MAX_FILE_BYTES = 16 * 1024 * 1024  # keeps every file under common git-host limits
EXPECTED_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "training_log.json"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def test_folder_holds_only_small_checkpoint_files():
    files = {p.name: p.stat().st_size for p in Path(DEFAULT_MODEL).iterdir()}
    assert set(files) == EXPECTED_FILES
    assert max(files.values()) <= MAX_FILE_BYTES


def test_model_is_a_small_qwen3(model):
    config = model.config
    assert config.model_type == "qwen3"
    assert config.max_position_embeddings == 512
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert 1e6 < sum(p.numel() for p in model.parameters()) < 5e6


def test_eos_is_a_real_special_token(model, tokenizer):
    eos = tokenizer.eos_token_id
    assert eos is not None and eos in tokenizer.all_special_ids
    # A real special token encodes to one id, never to the bytes "<", "|", ...
    assert tokenizer.encode(tokenizer.eos_token, add_special_tokens=False) == [eos]
    assert model.config.eos_token_id == eos
    assert model.generation_config.eos_token_id == eos
    assert not model.generation_config.do_sample


@pytest.mark.parametrize("source", [
    inspect.getsource(json.decoder),  # real code: docstrings, regexes, indentation
    "def f(x):\n\tif x:\n\t\treturn 'héllo ✓'  \n\n\n# trailing spaces, tabs, unicode\n",
])
def test_tokenizer_round_trips_python_source(tokenizer, source):
    ids = tokenizer.encode(source, add_special_tokens=False)
    assert tokenizer.decode(ids) == source
    assert tokenizer.eos_token_id not in ids


def test_tokenizer_compresses_code(tokenizer):
    source = inspect.getsource(json.decoder)
    # Byte-level BPE trained on code should need far fewer tokens than bytes.
    assert len(tokenizer.encode(source, add_special_tokens=False)) < len(source.encode()) / 2.5


def greedy(model, tokenizer, prompt: str, n: int = 40) -> torch.Tensor:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, ids.shape[1]:]


def test_greedy_generation_is_stable_and_decodable(model, tokenizer):
    first, second = greedy(model, tokenizer, "def "), greedy(model, tokenizer, "def ")
    assert torch.equal(first, second)
    text = tokenizer.decode(first, skip_special_tokens=True)
    assert text.strip() and "\ufffd" not in text  # real characters, no broken UTF-8


def test_beats_gzip_on_unseen_code():
    result = measure(max_bytes=20_000)
    bits = result["bits_per_byte"]
    assert 19_000 < result["bytes"] <= 20_000 and result["tokens"] > 0
    assert bits["model"] < bits["gzip -9"], bits
