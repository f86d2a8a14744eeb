"""Chapter 4: ragged batching (one flat run, segments apart) gives transformers' greedy
tokens; its block-diagonal mask, cu_seqlens and per-segment attention match hand-built and
dense references."""
from __future__ import annotations

import pytest
import torch

from mask_asserts import assert_mask_equal, mask
from minivllm.attention.masks import block_diagonal_mask
from minivllm.stages import ragged_batch
from minivllm.stages.common import StageStats
from minivllm.stages.kv_cache import KVCache
from tiny_models import raises_runtime_error, random_prompts, random_qkv, reference_attention

pytestmark = [pytest.mark.ch04, pytest.mark.floors]

PROMPT_LENS = [1, 37, 5, 1, 60, 12]
OUTPUT_LENS = [4, 1, 6, 3, 2, 5]


# --- offsets and the mask -------------------------------------------------------------------

@pytest.mark.parametrize("lengths, expected", [([3, 1, 2], [0, 3, 4, 6]), ([5], [0, 5]), ([], [0]),
                                              ([1, 1, 1, 1], [0, 1, 2, 3, 4])])
def test_cu_seqlens_by_hand(lengths, expected):
    got = ragged_batch.cu_seqlens(lengths)
    assert isinstance(got, list), f"cu_seqlens({lengths}) must return a list of ints, got {type(got).__name__}"
    assert got == expected, f"cu_seqlens({lengths}): expected {expected} (one more offset than lengths), got {got}"


@pytest.mark.timeout(30, func_only=True)  # fixtures built once per session are not timed
@pytest.mark.parametrize("wrong", [lambda cu: cu[:-1], lambda cu: cu[1:], lambda cu: [0] + cu[1:-1] + [cu[-1] + 1]],
                         ids=["no final offset", "no leading 0", "wrong total"])
def test_malformed_cu_seqlens_fails_at_once_instead_of_hanging(qwen3_model, monkeypatch, wrong):
    """Offsets that drop a segment leave a sequence without its token: the stage must refuse
    them, not wait for that token forever."""
    correct = ragged_batch.cu_seqlens
    monkeypatch.setattr(ragged_batch, "cu_seqlens", lambda lengths: wrong(correct(lengths)))
    with pytest.raises(ValueError, match=r"cu_seqlens\(\[4, 2, 3\]\) returned"):
        ragged_batch.generate(qwen3_model, random_prompts([4, 2, 3]), 3)


def test_block_diagonal_mask_one_token():
    assert_mask_equal(block_diagonal_mask([1]), mask(["1"]), "block_diagonal_mask([1])")


def test_block_diagonal_mask_equal_lengths():
    expected = mask(["1 . . .",
                     "1 1 . .",
                     ". . 1 .",
                     ". . 1 1"])
    assert_mask_equal(block_diagonal_mask([2, 2]), expected, "block_diagonal_mask([2, 2])")


def test_block_diagonal_mask_by_hand():
    expected = mask(["1 . . . . .",
                     "1 1 . . . .",
                     ". . 1 . . .",
                     ". . . 1 . .",
                     ". . . 1 1 .",
                     ". . . 1 1 1"])
    assert_mask_equal(block_diagonal_mask([2, 1, 3]), expected, "block_diagonal_mask([2, 1, 3])")


def test_block_diagonal_mask_is_causal_blocks():
    lengths = [4, 1, 7, 2, 3]
    expected = torch.block_diag(*[torch.ones(n, n).tril() for n in lengths])
    assert_mask_equal(block_diagonal_mask(lengths), expected, f"block_diagonal_mask({lengths})")


@pytest.mark.timeout(30, func_only=True)  # fixtures built once per session are not timed
def test_attention_that_moves_cache_length_is_named(qwen3_model, monkeypatch):
    """The stage owns cache.length: an attention that moves it (every layer!) is named at once."""
    correct = ragged_batch.RaggedAttention.__call__

    def moves_length(self, layer, q, k, v):
        for segment in self.segments:
            segment.cache.length += 1
        return correct(self, layer, q, k, v)

    monkeypatch.setattr(ragged_batch.RaggedAttention, "__call__", moves_length)
    with raises_runtime_error("the attention moved cache.length"):
        ragged_batch.generate(qwen3_model, random_prompts([4, 2]), 2)


# --- per-segment attention --------------------------------------------------------------------

def test_segment_attention_equals_dense_block_diagonal(model):
    """Prefill of three prompts at once: per segment == one dense [T, T] block-diagonal mask,
    built here by hand and computed in float64 (the exercise's own mask is checked above)."""
    lengths = [3, 1, 5]
    q, k, v = random_qkv(model, sum(lengths))
    segments = [ragged_batch.Segment(KVCache(model, n + 1), 0, n) for n in lengths]
    got = ragged_batch.RaggedAttention(segments)(0, q, k, v)
    assert got.shape == q.shape, f"RaggedAttention returns one row per query: expected {list(q.shape)}, got {list(got.shape)}"
    block_diagonal = torch.block_diag(*[torch.ones(n, n).tril() for n in lengths]).bool()
    expected = reference_attention(q, k, v, block_diagonal)
    for i, (start, n) in enumerate(zip([0, 3, 4], lengths)):
        torch.testing.assert_close(got[start:start + n].double(), expected[start:start + n], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"segment {i} (flat rows {start}..{start + n - 1}, a prefill of "
                                                 f"{n} tokens) differs from causal attention within it: {m}")
    for i, (segment, n, start) in enumerate(zip(segments, lengths, [0, 3, 4])):  # each cache holds its own keys only
        torch.testing.assert_close(segment.cache.k[0, :n], k[start:start + n],
                                   msg=lambda m: f"segment {i}'s cache rows 0..{n - 1} should hold its own keys: {m}")


def test_decode_segments_attend_to_their_own_cache(model):
    """A decode step: one new token per sequence, each against its whole cache."""
    lengths = [3, 1, 5]
    caches, history = [], []
    for n, seed in zip(lengths, [1, 2, 3]):  # fill each cache with a "past" of n tokens
        cache = KVCache(model, n + 1)
        _, k, v = random_qkv(model, n, seed)
        cache.k[0, :n], cache.v[0, :n], cache.length = k, v, n
        caches.append(cache)
        history.append((k, v))
    q, k, v = random_qkv(model, len(lengths), seed=4)
    segments = [ragged_batch.Segment(c, n, 1) for c, n in zip(caches, lengths)]
    got = ragged_batch.RaggedAttention(segments)(0, q, k, v)
    for i, ((old_k, old_v), n) in enumerate(zip(history, lengths)):
        sees_all = torch.ones(1, n + 1, dtype=torch.bool)  # one decode query sees its whole cache
        expected = reference_attention(q[i:i + 1], torch.cat([old_k, k[i:i + 1]]), torch.cat([old_v, v[i:i + 1]]), sees_all)
        torch.testing.assert_close(got[i:i + 1].double(), expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"decode segment {i} ({n} cached tokens + 1 new) saw the wrong keys: {m}")


# --- the schedule and the tokens -------------------------------------------------------------------

def test_finished_sequence_leaves_at_once(model):
    lengths = [4, 2, 3]
    stats = StageStats()
    plans = [step.plan for step in ragged_batch.steps(model, random_prompts(lengths), [1, 3, 2], stats=stats)]
    # (request, past, num_new): whole prompts first, then one token per live sequence.
    assert plans == [[(0, 0, 4), (1, 0, 2), (2, 0, 3)],
                     [(1, 2, 1), (2, 3, 1)],
                     [(1, 3, 1)]]
    assert (stats.token_slots, stats.wasted_slots) == (9 + 2 + 1, 0)


@pytest.mark.parametrize("batch_size", [4, 8])
def test_matches_transformers(model, hf_model, reference, batch_size):
    prompts = random_prompts(PROMPT_LENS)
    got = ragged_batch.generate(model, prompts, OUTPUT_LENS, batch_size=batch_size)
    for i, (p, n) in enumerate(zip(prompts, OUTPUT_LENS)):
        assert got[i] == reference(hf_model, p, n), f"prompt {i} ({len(p)} tokens) differs from transformers"


def test_changing_one_prompt_leaves_the_others_alone(model):
    prompts = random_prompts([9, 3, 14])
    before = ragged_batch.generate(model, prompts, 5)
    prompts[1] = random_prompts([20], seed=1)[0]  # longer, and it shifts every later segment
    after = ragged_batch.generate(model, prompts, 5)
    assert after[0] == before[0] and after[2] == before[2]


def test_same_tokens_as_static_batching_without_the_waste(model):
    from minivllm.stages import static_batch

    prompts, static, ragged = random_prompts(PROMPT_LENS), StageStats(), StageStats()
    assert ragged_batch.generate(model, prompts, OUTPUT_LENS, stats=ragged) == \
        static_batch.generate(model, prompts, OUTPUT_LENS, stats=static)
    useful = sum(p + n - 1 for p, n in zip(PROMPT_LENS, OUTPUT_LENS))  # the last token is never fed back
    assert ragged.token_slots == useful == static.token_slots - static.wasted_slots
