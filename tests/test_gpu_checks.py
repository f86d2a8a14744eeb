"""What only a GPU can show is correct: each chapter's promise on CUDA, in fp32, against
transformers' greedy tokens (computed on the CPU), or against the eager engine on the same GPU
where transformers cannot say (sampling, grammars). The engine here is the default one on a GPU:
CUDA graphs, fused Triton ops, Triton attention.

Marked `gpu` and skipped without a CUDA device: the runbook's gpu_checks part runs them
(`pytest -m gpu`), in about a minute on an H200. On a CPU they only have to import and collect.
"""
from __future__ import annotations

import json

import pytest
import torch
from tiny_models import random_prompts

from minivllm import LLM, SamplingParams, load_model, load_tokenizer
from minivllm.stages import STAGES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"), pytest.mark.floors]

PROMPTS = random_prompts([5, 17, 33, 9, 60, 24, 41, 12])
LENGTHS = [12, 7, 20, 16, 5, 11, 18, 9]
GREEDY = dict(temperature=0.0, ignore_eos=True)
EARLY_STAGES = ["naive", "kv_cache", "static_batch", "ragged_batch", "chunked_prefill", "paged"]  # chapters 1-6


@pytest.fixture(scope="module")
def cuda_model(hf_models):
    return load_model(hf_models["qwen3"], device="cuda", dtype=torch.float32)


@pytest.fixture(scope="module")
def expected(hf_models, reference):
    return [reference(hf_models["qwen3"], p, n) for p, n in zip(PROMPTS, LENGTHS)]


def greedy(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in lengths]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("stage", EARLY_STAGES)
def test_each_early_stage_gives_transformers_tokens_on_cuda(cuda_model, expected, stage):
    assert STAGES[stage](cuda_model, PROMPTS, LENGTHS) == expected


def test_chunked_prefill_and_preemption_give_transformers_tokens(cuda_model, expected):
    """A starved engine: 24-token steps chunk every long prompt, 18 blocks of 4 tokens force
    recompute-preemptions; decode steps still replay graphs."""
    llm = LLM(cuda_model, block_size=4, num_kv_blocks=18, max_num_batched_tokens=24, max_num_seqs=7)
    outputs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the pool was meant to run out"


def test_prefix_caching_on_and_off_give_the_same_tokens(cuda_model, hf_models, reference):
    """Prompts sharing a 48-token prefix (3 full blocks of 16): with the cache the later ones skip
    it; the tokens must not change, and both must be transformers'."""
    shared = random_prompts([48], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([3, 9, 20, 1], seed=4)]
    lengths = [10, 14, 6, 12]
    want = [reference(hf_models["qwen3"], p, n) for p, n in zip(prompts, lengths)]
    on, off = LLM(cuda_model, enable_prefix_caching=True), LLM(cuda_model, enable_prefix_caching=False)
    assert greedy(on, prompts[:1], lengths[:1]) == want[:1]  # fills the cache with the shared blocks
    outputs = on.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert all(o.num_cached_tokens >= 48 for o in outputs), [o.num_cached_tokens for o in outputs]
    assert greedy(off, prompts, lengths) == want


def test_ngram_speculation_gives_transformers_tokens(cuda_model, hf_models, reference):
    """Repetitive prompts, so the n-gram proposer guesses and some guesses are kept: greedy
    verification must keep exactly the target's tokens."""
    base = random_prompts([6, 8], seed=5)
    prompts = [base[0] * 5, base[1] * 4 + base[0]]
    lengths = [24, 20]
    llm = LLM(cuda_model, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [reference(hf_models["qwen3"], p, n)
                                                         for p, n in zip(prompts, lengths)]
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0, "the proposer never guessed"


def test_seeded_sampling_is_the_eager_engines_and_does_not_depend_on_the_batch(cuda_model):
    """transformers cannot say what a seeded draw gives; the eager engine on the same GPU can.
    A seeded request samples the same tokens alone, in a batch of unseeded neighbours, and on the
    eager engine (fp32: the same logits to within rounding far below the draws' gaps)."""
    mine = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    noisy = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True) for n in (4, 20, 9)]
    default, eager = LLM(cuda_model), LLM(cuda_model, cuda_graphs=False, fused_ops=False)
    alone = default.generate(PROMPTS[:1], [mine], use_tqdm=False)[0].outputs[0].token_ids
    in_batch = default.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]], [noisy[0], mine, *noisy[1:]],
                                use_tqdm=False)[1].outputs[0].token_ids
    assert alone == in_batch == eager.generate(PROMPTS[:1], [mine], use_tqdm=False)[0].outputs[0].token_ids


def test_structured_outputs_on_cuda_are_valid_and_the_eager_engines():
    """A JSON schema and a choice on the embedded model (it has a tokenizer): the output parses
    and fits, and the default engine's tokens are the eager engine's."""
    pytest.importorskip("xgrammar")
    from minivllm import StructuredOutputsParams

    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    model = load_model(device="cuda", dtype=torch.float32)
    params = [SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(max_tokens=8, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe not"]))]
    prompts = ["A person as JSON: ", "Is it raining? Answer: "]
    tokenizer = load_tokenizer()
    default, eager = LLM(model, tokenizer=tokenizer), LLM(model, tokenizer=tokenizer, cuda_graphs=False, fused_ops=False)
    got = default.generate(prompts, params, use_tqdm=False)
    record = json.loads(got[0].outputs[0].text)
    assert set(record) == {"name", "age"} and isinstance(record["name"], str) and isinstance(record["age"], int)
    assert got[1].outputs[0].text in ("yes", "no", "maybe not")
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids
                                                     for o in eager.generate(prompts, params, use_tqdm=False)]


def test_a_config_only_model_drawn_on_the_gpu_is_one_model_at_every_size(tmp_path):
    """Chapter 14: a bare config's random weights are drawn on the GPU (fast), and every rank's
    shard drawn there equals the one cut from the whole model drawn there."""
    from minivllm.distributed.direct_load import load_shard
    from minivllm.distributed.layers import Communicator
    from minivllm.distributed.shard import shard_decoder
    from minivllm.loader import open_weights

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="qwen3", vocab_size=1000, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False)))
    whole = load_model(config, "cuda", torch.float32)
    assert whole.layers[0].mlp.up_proj.weight.is_cuda
    assert abs(whole.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.002
    for rank in range(2):
        cut = shard_decoder(whole, Communicator(rank, 2)).state_dict()
        read = load_shard(open_weights(config, "cuda"), Communicator(rank, 2), "cuda", torch.float32).state_dict()
        for name in cut:
            assert torch.equal(cut[name], read[name]), f"rank {rank}: {name}"


def test_two_copies_on_the_gpu_give_one_engines_tokens(hf_models, expected):
    """Chapter 14's copies: LLM(data_parallel_size=2) on CUDA (two core processes; with one GPU,
    both on it) gives transformers' greedy tokens."""
    llm = LLM(hf_models["qwen3"], device="cuda", dtype=torch.float32, data_parallel_size=2, num_kv_blocks=256)
    try:
        assert greedy(llm, PROMPTS, LENGTHS) == expected
        assert min(llm.engine.client.async_client.sent) > 0
    finally:
        llm.shutdown()
