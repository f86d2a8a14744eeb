"""Chapter 3: static batching with left padding gives transformers' greedy tokens, its mask
hides padding, and its waste count agrees with a count done by hand."""
from __future__ import annotations

import pytest
import torch

from mask_asserts import assert_mask_equal, mask
from minivllm.attention.masks import padded_causal_mask
from minivllm.stages import static_batch
from minivllm.stages.common import StageStats
from tiny_models import random_prompts

pytestmark = [pytest.mark.ch03, pytest.mark.floors]

# Lengths far apart in one batch, one-token prompts, and per-prompt output lengths.
PROMPT_LENS = [1, 37, 5, 1, 60, 12]
OUTPUT_LENS = [4, 1, 6, 3, 2, 5]


# --- the mask ---------------------------------------------------------------------------

def test_padded_mask_one_token_prompt():
    assert_mask_equal(padded_causal_mask([1]), mask(["1"])[None], "padded_causal_mask([1])")


def test_padded_mask_equal_lengths_is_causal_per_row():
    causal = mask(["1 . .",
                   "1 1 .",
                   "1 1 1"])
    assert_mask_equal(padded_causal_mask([3, 3]), torch.stack([causal, causal]), "padded_causal_mask([3, 3])")


def test_padded_mask_hides_padding_by_hand():
    # L = 3. Row 0 has no padding; row 1 has 2 padding slots, row 2 has 1.
    # Padding queries see only themselves; real queries never see padding keys.
    expected = torch.stack([
        mask(["1 . .",
              "1 1 .",
              "1 1 1"]),
        mask(["1 . .",
              ". 1 .",
              ". . 1"]),
        mask(["1 . .",
              ". 1 .",
              ". 1 1"]),
    ])
    assert_mask_equal(padded_causal_mask([3, 1, 2]), expected, "padded_causal_mask([3, 1, 2])")


def test_every_query_sees_at_least_one_key():
    # An all-hidden row would give softmax(all -inf) = NaN and poison the batch (see masks.py).
    m = padded_causal_mask([1, 6, 2, 4])
    assert m.any(dim=-1).all(), "some query row hides every key: its softmax would be NaN"


# --- left padding and positions -----------------------------------------------------------

def test_left_pad_by_hand():
    ids, positions = static_batch.left_pad([[5, 6, 7], [8], [9, 4]])
    P = static_batch.PAD_ID
    assert ids.tolist() == [[5, 6, 7], [P, P, 8], [P, 9, 4]], "prompts go to the right, padding to the left"
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 1]], \
        "positions start at 0 on each row's first real token (padding: 0)"


# --- the waste count ------------------------------------------------------------------------

def test_count_waste_by_hand():
    # Prompts 3, 1, 2 -> L = 3; outputs 2, 4, 1 -> the batch runs 4 forward passes.
    # Prefill: 3 x 3 = 9 slots, of which padding 0 + 2 + 1 = 3.
    # Decode steps 1, 2, 3: 3 slots each; rows already done: 1 (row 2), 2 (rows 0, 2), 2.
    assert static_batch.count_waste([3, 1, 2], [2, 4, 1]) == (9 + 3 * 3, 3 + 1 + 2 + 2)
    # One row: no padding, nothing finishes early.
    assert static_batch.count_waste([4], [3]) == (4 + 2, 0)
    # Equal prompts, one output each: the prefill is all there is, and none of it is waste.
    assert static_batch.count_waste([2, 2], [1, 1]) == (4, 0)


def test_stats_count_what_the_model_computed(model):
    seen = []
    hook = model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    stats = StageStats()
    try:
        static_batch.generate(model, random_prompts([3, 1, 2]), [2, 4, 1], stats=stats, batch_size=2)
    finally:
        hook.remove()
    # Batch [3, 1] with outputs [2, 4]: 2 x 3 prefill + 3 decode steps x 2 = 12 slots,
    # wasted: 2 padding + 2 steps of row 0 after its 2 tokens = 4.
    # Batch [2] with output [1]: 2 slots, no waste.
    assert sum(seen) == 12 + 2, "the model did not compute the rectangle static batching implies"
    assert (stats.token_slots, stats.wasted_slots) == (14, 4)


def test_kv_record_by_hand(model):
    stats = StageStats()
    static_batch.generate(model, random_prompts([3, 1]), [2, 1], stats=stats)
    # Cache rectangle: 2 rows x (L = 3 + 2 outputs) = 10 slots reserved at each of the 2 steps.
    # Real tokens after prefill: 3 + 1; after decode step 1: row 0 has 4, row 1 is done (still 1).
    assert (stats.kv_used, stats.kv_reserved, stats.peak_kv_tokens) == (4 + 5, 10 + 10, 10)


# --- the tokens -------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [4, 8])
def test_matches_transformers(model, hf_model, reference, batch_size):
    prompts = random_prompts(PROMPT_LENS)
    got = static_batch.generate(model, prompts, OUTPUT_LENS, batch_size=batch_size)
    for i, (p, n) in enumerate(zip(prompts, OUTPUT_LENS)):
        assert got[i] == reference(hf_model, p, n), f"prompt {i} ({len(p)} tokens) differs from transformers"


def test_changing_one_prompt_leaves_the_others_alone(model):
    prompts = random_prompts([9, 3, 14])
    before = static_batch.generate(model, prompts, 5)
    # Prompt 1 gets longer than all others: every other row's padding changes, its output must not.
    prompts[1] = random_prompts([20], seed=1)[0]
    after = static_batch.generate(model, prompts, 5)
    assert after[0] == before[0] and after[2] == before[2]


def test_zero_new_tokens_computes_nothing(model, hf_model, reference):
    prompts, stats = random_prompts([4, 2]), StageStats()
    got = static_batch.generate(model, prompts, [0, 2], stats=stats)
    assert got == [[], reference(hf_model, prompts[1], 2)]
    assert stats.token_slots == 2 + 1, "a request for no tokens should not take a row of the batch"
