"""Chapter 2: appending to the cache, and cached decode equal to transformers' greedy tokens."""
from __future__ import annotations

import pytest
import torch

from minivllm.stages import kv_cache
from minivllm.stages.common import StageStats

pytestmark = [pytest.mark.ch02, pytest.mark.floors]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [42], [3] * 25]


def test_append_kv_writes_rows_and_returns_the_filled_part():
    cache = torch.full((6, 2, 3), -1.0)
    first, second = torch.randn(3, 2, 3), torch.randn(1, 2, 3)
    filled = kv_cache.append_kv(cache, first, start=0)
    assert filled.shape == (3, 2, 3), f"after 3 tokens the filled part is [3, 2, 3], got {list(filled.shape)}"
    filled = kv_cache.append_kv(cache, second, start=3)
    assert filled.shape == (4, 2, 3), f"after 4 tokens the filled part is [4, 2, 3], got {list(filled.shape)}"
    torch.testing.assert_close(filled, torch.cat([first, second]))
    assert (cache[4:] == -1).all(), "rows past the written tokens must stay untouched"


def test_kv_cache_equals_transformers(model, hf_model, reference):
    lengths = [6, 1, 9]
    got = kv_cache.generate(model, PROMPTS, lengths)
    for prompt, n, out in zip(PROMPTS, lengths, got):
        assert out == reference(hf_model, prompt, n), f"prompt of {len(prompt)} tokens"


def test_kv_cache_does_linear_work(model):
    """Naive decode pushes O(N^2) tokens through the model, the cache O(N)."""
    stats = StageStats()
    kv_cache.generate(model, [[1, 2, 3, 4]], 5, stats=stats)
    assert stats.token_slots == 4 + 4  # the prompt once, then one token per later step
    assert stats.peak_kv_tokens == 4 + 5
