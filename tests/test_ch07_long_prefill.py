"""Chapter 7 (issue 48): the step's token budget and batch size chosen by the device, and a cap
on one request's prompt tokens per step (long_prefill_token_threshold) so that the newcomers of
a burst start together. The cap changes plans, never tokens: greedy outputs equal transformers'."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_models import random_prompts

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.config.engine import default_batch_limits
from minivllm.core.block_manager import BlockManager
from minivllm.core.scheduler import Scheduler
from minivllm.request.sequence import Sequence

pytestmark = [pytest.mark.ch07, pytest.mark.floors]


@pytest.mark.parametrize("name, gib, expected", [("NVIDIA H200", 141, (8192, 1024)), ("NVIDIA H100 80GB HBM3", 80, (8192, 1024)),
                                                 ("NVIDIA A100-SXM4-80GB", 80, (2048, 256)),
                                                 ("NVIDIA GeForce RTX 4090", 24, (2048, 256))])
def test_the_defaults_follow_vllms_table_by_device(monkeypatch, name, gib, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=gib * 2**30))
    assert default_batch_limits(torch.device("cuda", 0)) == expected


def test_cpu_defaults_and_the_users_values_win(qwen3_model):
    assert default_batch_limits(torch.device("cpu")) == (2048, 256)
    resolved = EngineConfig(num_kv_blocks=64).resolve(qwen3_model)
    assert (resolved.max_num_batched_tokens, resolved.max_num_seqs) == (2048, 256)
    mine = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=100, max_num_seqs=3).resolve(qwen3_model)
    assert (mine.max_num_batched_tokens, mine.max_num_seqs) == (100, 3)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            EngineConfig(long_prefill_token_threshold=bad)


def first_token_steps(prompt_lens: list[int], budget: int, threshold: int) -> list[int]:
    """The step (1, 2, ...) at which each request's whole prompt is computed, all arriving at once."""
    scheduler = Scheduler(BlockManager(1000, 4), budget, 64, long_prefill_token_threshold=threshold)
    seqs = [Sequence(str(i), [1] * n, SamplingParams(max_tokens=4), max_model_len=4000) for i, n in enumerate(prompt_lens)]
    for seq in seqs:
        scheduler.add(seq)
    done: dict[str, int] = {}
    for step in range(1, 100):
        out = scheduler.schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens >= seq.num_prompt_tokens and seq.request_id not in done:
                done[seq.request_id] = step
        if len(done) == len(seqs):
            break
    return [done[s.request_id] for s in seqs]


def test_the_cap_lets_short_prompts_start_beside_long_ones():
    lens = [400, 400, 16, 16, 16]
    assert first_token_steps(lens, budget=256, threshold=0) == [2, 4, 4, 4, 4]  # the long ones take the budget
    assert first_token_steps(lens, budget=256, threshold=64) == [7, 7, 1, 1, 1]  # the short ones start at once


def test_a_cap_grants_at_most_its_tokens_to_a_prompt_and_leaves_decodes_alone():
    scheduler = Scheduler(BlockManager(1000, 4), 2048, 64, long_prefill_token_threshold=32)
    seq = Sequence("a", [1] * 100, SamplingParams(max_tokens=4), max_model_len=4000)
    assert scheduler.wanted(seq) == 32
    seq.num_computed_tokens = 90
    assert scheduler.wanted(seq) == 10
    seq.num_computed_tokens = 100
    seq.token_ids += [5, 6, 7]  # three tokens past the prompt (as a draft to verify): not a prompt, not capped
    assert scheduler.wanted(seq) == 3


def test_greedy_tokens_equal_transformers_with_the_cap(qwen3_model, hf_models, reference):
    prompts = random_prompts([70, 5, 33, 90, 12], seed=3)
    llm = LLM(qwen3_model, num_kv_blocks=128, max_num_batched_tokens=48, long_prefill_token_threshold=8)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == reference(hf_models["qwen3"], prompt, 6)
