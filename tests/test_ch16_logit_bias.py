"""Chapter 16 with vLLM's bad_words (issue 49): async scheduling plans a step before the last
step's tokens are known, and a multi-token bad word needs them."""
from __future__ import annotations

import pytest

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
