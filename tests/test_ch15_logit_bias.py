"""Chapter 15 with vLLM's bad_words, logit_bias and allowed_token_ids (issue 49): the frontend
tokenizes the bad words, and the token ids cross to the core process with the rest of the params."""
from __future__ import annotations

import dataclasses

import pytest

from minivllm import LLM, LLMEngine, SamplingParams

pytestmark = [pytest.mark.ch15, pytest.mark.floors]

PROMPT = "def add(a, b):"
ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8}
STEPS = 16


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


@pytest.mark.slow
def test_the_edits_cross_to_a_core_process(llm):
    """The frontend tokenizes bad_words; the token ids travel to the core process with the rest
    of the params, and the core process samples what the in-thread core samples."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, bad_words=["the value"],
                            logit_bias={4000: 0.5}, allowed_token_ids=list(range(4096)))
    want = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    without = dataclasses.replace(params, bad_words=None)
    assert llm.generate(PROMPT, without, use_tqdm=False)[0].outputs[0].token_ids != want  # the words matter
    # the core process is spawned with the package's defaults; give it the in-thread engine's
    # persistent batch (chapter 16's, off as of this chapter) so it runs the same chapter's engine
    engine = LLMEngine(multiprocess=True, persistent_batch=llm.engine.config.persistent_batch, **ENGINE)
    try:
        engine.add_request(request_id="r", prompt=PROMPT, params=params)
        got = None
        for _ in range(10 * STEPS):
            for out in engine.step():
                if out.finished:
                    got = out.outputs[0].token_ids
            if got is not None:
                break
    finally:
        engine.shutdown()
    assert got == want
