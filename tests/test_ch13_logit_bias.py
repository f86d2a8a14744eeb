"""Issue 49 with chapter 13: no answer carries a non-finite float. A token a grammar forbids has
logprob -inf, which JSON cannot carry; answers report it as vLLM does, -9999.0. The issue's case
(chat, logprobs with top_logprobs 5, structured_outputs choice) through the official openai client
answers 200, and a property over grammars, penalties, biases, whitelists and bad words finds no
-inf or NaN in any answer body. And the grammar's mask and a request's logit edits together: the
grammar decides what may come, the edits which of it."""
from __future__ import annotations

import json
import math

import pytest
from server_checks import MODEL, openai_client, running_server

from minivllm import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from minivllm.entrypoints.openai.responses import chat_response, completion_response
from minivllm.request.logprobs import LOWEST_LOGPROB

pytestmark = [pytest.mark.ch13, pytest.mark.floors]
pytest.importorskip("xgrammar")

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16}
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Add two numbers."}]


@pytest.fixture(scope="module")
def llm(default_model, chat_tokenizer) -> LLM:
    return LLM(default_model, tokenizer=chat_tokenizer, **ENGINE)


@pytest.fixture(scope="module")
def client(default_model, chat_tokenizer):
    with running_server(LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)) as (url, _):
        yield openai_client(url)


def greedy(llm: LLM, **kwargs) -> str:
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10, **kwargs), use_tqdm=False)[0].outputs[0].text


def test_the_issue_case_chat_top_logprobs_under_a_choice_grammar(client):
    choices = ["yes", "no", "maybe"]
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=5,
                                            extra_body={"structured_outputs": {"choice": choices}}, max_tokens=8)
    assert answer.choices[0].message.content in choices
    values = [t.logprob for t in answer.choices[0].logprobs.content]
    values += [alt.logprob for t in answer.choices[0].logprobs.content for alt in t.top_logprobs]
    assert all(math.isfinite(v) and v >= LOWEST_LOGPROB for v in values)
    assert LOWEST_LOGPROB in values  # fewer than 5 tokens are allowed: forbidden ones fill the top 5


def test_the_grammar_and_the_bias_apply_together(llm):
    """The grammar decides what may come, the bias which of it: a bias for the first token of
    another choice picks it, and a bias for a token the grammar forbids changes nothing. A
    whitelist disjoint from what the grammar allows leaves no token: the grammar's rule wins
    (worker/logit_bias.py), and the answer is still one of the choices."""
    tokenizer = llm.get_tokenizer()
    grammar = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    plain = greedy(llm, structured_outputs=grammar)
    assert plain in ("yes", "no", "maybe")
    target = next(c for c in ("maybe", "no", "yes") if c != plain)
    first = tokenizer.encode(target, add_special_tokens=False)[0]
    assert greedy(llm, structured_outputs=grammar, logit_bias={first: 30.0}) == target
    outside = tokenizer.encode(" def", add_special_tokens=False)[0]
    assert greedy(llm, structured_outputs=grammar, logit_bias={outside: 100.0}) == plain
    assert greedy(llm, structured_outputs=grammar, allowed_token_ids=[outside]) == plain
    assert greedy(llm, structured_outputs=grammar, bad_words=[plain]) in ("yes", "no", "maybe")


@pytest.mark.slow
def test_no_answer_body_carries_a_non_finite_float(llm):
    """A property over grammars, penalties, biases, whitelists and bad words, sampled or greedy:
    the completions and chat bodies built from the outputs (logprobs with alternatives, prompt
    logprobs) are valid JSON, which has no -inf or NaN."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    grammars = st.sampled_from([None, StructuredOutputsParams(choice=["yes", "no", "maybe"]),
                                StructuredOutputsParams(regex="[a-c]{1,4}")])
    biases = st.dictionaries(st.integers(0, 4095), st.floats(-100, 100), max_size=4)
    params = st.fixed_dictionaries({
        "structured_outputs": grammars,
        "temperature": st.sampled_from([0.0, 0.7, 1.5]),
        "repetition_penalty": st.sampled_from([1.0, 1.3]),
        "frequency_penalty": st.sampled_from([0.0, 1.0]),
        "logit_bias": st.one_of(st.none(), biases),
        "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 4095), min_size=1, max_size=50)),
        "bad_words": st.sampled_from([None, ["the"], ["a", "b c"]]),
        "logprobs": st.integers(0, 8),
        "seed": st.integers(0, 2**16),
    })

    @hypothesis.settings(max_examples=30, deadline=None, derandomize=True, database=None)
    @hypothesis.given(params)
    def check(kwargs):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=6, prompt_logprobs=kwargs["logprobs"], **kwargs),
                           use_tqdm=False)
        k = kwargs["logprobs"]
        for body in (completion_response(out, "id", 0, MODEL, k, show_prompt_logprobs=True),
                     chat_response(out, "id", 0, MODEL, k)):
            json.dumps(body, allow_nan=False)  # ValueError on -inf or NaN: a 500 in the server
        assert math.isfinite(out[0].outputs[0].cumulative_logprob)

    check()
