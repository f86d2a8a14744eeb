"""Chapter 1: the causal mask, and naive decode equal to transformers' greedy tokens."""
from __future__ import annotations

import pytest
import torch

from mask_asserts import assert_mask_equal
from minivllm.attention.masks import causal_mask
from minivllm.stages import naive

pytestmark = [pytest.mark.ch01, pytest.mark.floors]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [42], [3] * 25]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_causal_mask_against_hand_built(n):
    expected = torch.tensor([[j <= i for j in range(n)] for i in range(n)])
    assert_mask_equal(causal_mask(n), expected, f"causal_mask({n})")


def test_naive_equals_transformers(model, hf_model, reference):
    lengths = [6, 1, 9]
    got = naive.generate(model, PROMPTS, lengths)
    for prompt, n, out in zip(PROMPTS, lengths, got):
        assert out == reference(hf_model, prompt, n), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize(
    "prompts, max_new, message",
    [([[]], 3, "empty"), ([[1, 10_000]], 3, "outside the vocabulary"), ([[1] * 250], 10, "context"),
     ([[1], [2]], [3], "2 prompts")],
)
def test_bad_requests_are_refused(model, prompts, max_new, message):
    with pytest.raises(ValueError, match=message):
        naive.generate(model, prompts, max_new)
