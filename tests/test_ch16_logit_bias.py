"""Chapter 16 with vLLM's bad_words (issue 49): async scheduling plans a step before the last
step's tokens are known, and a multi-token bad word needs them. On a GPU (marked `gpu`), the
default engine there (async scheduling, CUDA graphs, Triton) gives the CPU engine's tokens
under every edit, with and without speculation."""
from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams

pytestmark = [pytest.mark.ch16, pytest.mark.floors]

PROMPT = "def add(a, b):"
ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8}
STEPS = 16


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


def test_bad_words_under_async_scheduling(llm):
    """Async scheduling plans step N+1 before step N's token is known; a multi-token bad word
    needs that token, so while a request has bad words the steps run one after the other."""
    overlapping = LLM(async_scheduling=True, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, bad_words=["the value"])
    want = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert overlapping.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_the_gpu_engine_gives_the_cpu_engines_tokens(llm, speculative_config):
    gpu = LLM(device="cuda", dtype=torch.float32, speculative_config=speculative_config, **ENGINE)
    cases = [{"logit_bias": {266: 5.0, 383: -100.0}}, {"allowed_token_ids": [10, 266, 383, 500, 972]},
             {"bad_words": ["the value", "Return"]},
             {"logit_bias": {266: 1.5}, "bad_words": ["the value"], "repetition_penalty": 1.2}]
    for kwargs in cases:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, **kwargs)
        want = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        got = gpu.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids, kwargs
        assert [e[t].logprob for e, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
            [e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-3)
