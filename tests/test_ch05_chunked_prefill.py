"""Chapter 5: chunked prefill under a token budget gives transformers' greedy tokens for any
chunk size; the chunk mask and the step planner match hand-built references."""
from __future__ import annotations

import pytest
import torch

from mask_asserts import assert_mask_equal, mask
from minivllm.attention.masks import chunk_mask
from minivllm.stages import chunked_prefill
from minivllm.stages.common import StageStats
from minivllm.stages.kv_cache import KVCache
from minivllm.stages.ragged_batch import Segment
from tiny_models import random_prompts, random_qkv, reference_attention

pytestmark = [pytest.mark.ch05, pytest.mark.floors]

# Prompt 1 is many chunks long at every chunk size below; prompt 0 has one token.
PROMPT_LENS = [1, 45, 9, 30]
OUTPUT_LENS = [6, 3, 5, 4]


# --- the chunk mask ----------------------------------------------------------------------------

def test_chunk_mask_without_past_is_causal():
    expected = mask(["1 . .",
                     "1 1 .",
                     "1 1 1"])
    assert_mask_equal(chunk_mask(3, 0), expected, "chunk_mask(3, past=0)")


def test_chunk_mask_by_hand():
    # Two new tokens after three cached ones: all of the cache, causal within the chunk.
    expected = mask(["1 1 1 1 .",
                     "1 1 1 1 1"])
    assert_mask_equal(chunk_mask(2, 3), expected, "chunk_mask(2, past=3)")
    assert_mask_equal(chunk_mask(1, 4), mask(["1 1 1 1 1"]), "chunk_mask(1, past=4): a decode step")


def test_chunk_masks_stack_into_the_causal_mask():
    n, size = 10, 4
    stacked = torch.zeros(n, n, dtype=torch.bool)
    for past in range(0, n, size):
        q_len = min(size, n - past)
        stacked[past:past + q_len, :past + q_len] = chunk_mask(q_len, past)
    assert_mask_equal(stacked, torch.ones(n, n).tril(), f"chunk masks of a {n}-token prompt in chunks of {size}")


# --- the planner ----------------------------------------------------------------------------------

def test_plan_decodes_first_then_chunks():
    # Sequences 0 and 1 decode (1 token each), 2 has 10 prompt tokens left, 3 has 3.
    assert chunked_prefill.plan_step([10, 0, 3, 0], chunk_size=4, budget=7) == [(1, 1), (3, 1), (0, 4), (2, 1)]


def test_plan_respects_the_budget():
    assert chunked_prefill.plan_step([0, 0, 0, 5], chunk_size=4, budget=2) == [(0, 1), (1, 1)]
    assert chunked_prefill.plan_step([10, 10], chunk_size=4, budget=6) == [(0, 4), (1, 2)]


def test_plan_chunks_no_longer_than_the_prompt_left():
    assert chunked_prefill.plan_step([3, 2], chunk_size=8, budget=100) == [(0, 3), (1, 2)]
    assert chunked_prefill.plan_step([10, 10], chunk_size=4, budget=100) == [(0, 4), (1, 4)]


@pytest.mark.timeout(30, func_only=True)  # fixtures built once per session are not timed
@pytest.mark.parametrize("wrong, problem", [
    (lambda plan: [], "no tokens planned"),  # a step that runs nothing: the loop would spin forever
    (lambda plan: [(i, 0) for i, _ in plan], "may run 1"),  # tokens planned, none of them real
    (lambda plan: plan + plan[:1], "at most once"),
    (lambda plan: [(i, n + 100) for i, n in plan], "may run 1"),  # past the prompt's end
], ids=["empty", "zero tokens", "a sequence twice", "past the prompt"])
def test_a_broken_plan_fails_at_once_instead_of_hanging(qwen3_model, monkeypatch, wrong, problem):
    correct = chunked_prefill.plan_step
    monkeypatch.setattr(chunked_prefill, "plan_step", lambda *args: wrong(correct(*args)))
    with pytest.raises(ValueError, match=rf"plan_step\(\[.*\], chunk_size=4, budget=6\) returned .*{problem}"):
        chunked_prefill.generate(qwen3_model, random_prompts([9, 3]), 4, chunk_size=4, max_num_batched_tokens=6)


# --- attention over chunks -------------------------------------------------------------------------

def test_chunked_attention_equals_whole_prompt(model):
    """Chunks of 4 attending to the cache of the chunks before them == the whole prompt at once,
    with a causal mask built here and computed in float64."""
    n = 11
    q, k, v = random_qkv(model, n)
    cache, outs = KVCache(model, n), []
    for past in range(0, n, 4):
        rows = slice(past, min(past + 4, n))
        segment = Segment(cache, past, rows.stop - past)
        outs.append(chunked_prefill.ChunkedAttention([segment])(0, q[rows], k[rows], v[rows]))
    expected = reference_attention(q, k, v, torch.ones(n, n).tril().bool())
    for past in range(0, n, 4):
        rows = slice(past, min(past + 4, n))
        torch.testing.assert_close(torch.cat(outs)[rows].double(), expected[rows], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"the chunk at positions {rows.start}..{rows.stop - 1} "
                                                 f"(after {past} cached tokens): {m}")


# --- the tokens -----------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size, budget", [
    (8, 12),  # prompt 1 in 6 chunks; chunks of two sequences share steps with decodes
    (1, 3),  # one prompt token at a time
    (9, 16),  # exactly prompt 2's length
    (45, 45),  # exactly the longest prompt's length
])
def test_matches_transformers(model, hf_model, reference, chunk_size, budget):
    prompts = random_prompts(PROMPT_LENS)
    got = chunked_prefill.generate(model, prompts, OUTPUT_LENS, chunk_size=chunk_size, max_num_batched_tokens=budget)
    for i, (p, n) in enumerate(zip(prompts, OUTPUT_LENS)):
        assert got[i] == reference(hf_model, p, n), \
            f"prompt {i} ({len(p)} tokens, chunks of {chunk_size}) differs from transformers"


def test_budget_mixes_decodes_and_chunks(model, hf_model, reference):
    prompts, stats = random_prompts([2, 20]), StageStats()
    steps = list(chunked_prefill.steps(model, prompts, [6, 3], chunk_size=4, max_num_batched_tokens=5, stats=stats))
    # Step 0: prompt 0 whole (2) + a chunk of prompt 1 (3). Then prompt 0 decodes (1 token)
    # while prompt 1 goes on in chunks of 4: (request, past, num_new).
    assert steps[0].plan == [(0, 0, 2), (1, 0, 3)]
    assert steps[1].plan == [(0, 2, 1), (1, 3, 4)]
    assert all(len(s.plan) <= 2 and sum(n for _, _, n in s.plan) <= 5 for s in steps)
    assert steps[0].produced == [(0, reference(hf_model, prompts[0], 1)[0])], "a mid-prompt chunk samples nothing"
    outputs = {0: [], 1: []}
    for step in steps:
        for request, token in step.produced:
            outputs[request].append(token)
    assert outputs == {0: reference(hf_model, prompts[0], 6), 1: reference(hf_model, prompts[1], 3)}
    assert stats.token_slots == (2 + 6 - 1) + (20 + 3 - 1) and stats.wasted_slots == 0


def test_changing_one_prompt_leaves_the_others_alone(model):
    prompts = random_prompts([9, 3, 14])
    before = chunked_prefill.generate(model, prompts, 5, chunk_size=4, max_num_batched_tokens=6)
    prompts[1] = random_prompts([20], seed=1)[0]  # changes how every step is packed
    after = chunked_prefill.generate(model, prompts, 5, chunk_size=4, max_num_batched_tokens=6)
    assert after[0] == before[0] and after[2] == before[2]
