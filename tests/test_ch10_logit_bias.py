"""Issue 49 over HTTP, through the official openai client: `logit_bias` (OpenAI's), and vLLM's
`allowed_token_ids` and `bad_words` (through extra_body) on /v1/completions and
/v1/chat/completions give what LLM.generate gives with the same SamplingParams; bad values are a
400 that names them. And no answer carries a non-finite float: a grammar's forbidden tokens have
logprob -inf, reported as vLLM reports them, -9999.0 (the issue's case: chat, top_logprobs 5,
structured_outputs choice), checked as a property over grammars, penalties and edits."""
from __future__ import annotations

import json
import math

import openai
import pytest
from server_checks import MODEL, openai_client, running_server

from minivllm import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from minivllm.entrypoints.openai.responses import chat_response, completion_response
from minivllm.request.logprobs import LOWEST_LOGPROB

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16}
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Add two numbers."}]
GREEDY = {"temperature": 0, "max_tokens": 10}


@pytest.fixture(scope="module")
def llm(default_model, chat_tokenizer) -> LLM:
    return LLM(default_model, tokenizer=chat_tokenizer, **ENGINE)


@pytest.fixture(scope="module")
def client(default_model, chat_tokenizer):
    with running_server(LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)) as (url, _):
        yield openai_client(url)


def offline(llm: LLM, chat: bool, **kwargs):
    params = SamplingParams(**GREEDY, **kwargs)
    out = llm.chat(MESSAGES, params, use_tqdm=False) if chat else llm.generate(PROMPT, params, use_tqdm=False)
    return out[0].outputs[0]


def served(client: openai.OpenAI, chat: bool, **fields):
    """(text, token logprobs) of one greedy answer; logit_bias as OpenAI's own parameter, the
    vLLM fields through extra_body, as a vLLM user sends them."""
    bias = fields.pop("logit_bias", openai.NOT_GIVEN)
    if chat:
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, logit_bias=bias, logprobs=True,
                                                extra_body=fields, **GREEDY).choices[0]
        return answer.message.content, [t.logprob for t in answer.logprobs.content]
    answer = client.completions.create(model=MODEL, prompt=PROMPT, logit_bias=bias, logprobs=0, extra_body=fields,
                                       **GREEDY).choices[0]
    return answer.text, answer.logprobs.token_logprobs


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_each_field_gives_what_llm_generate_gives(client, llm, chat):
    plain = offline(llm, chat)
    first = plain.token_ids[0]
    cases = [({"logit_bias": {str(first): -100, "266": 5}}, {"logit_bias": {first: -100.0, 266: 5.0}}),
             ({"allowed_token_ids": [10, 266, 383, 972]}, {"allowed_token_ids": [10, 266, 383, 972]}),
             ({"bad_words": [llm.get_tokenizer().decode(plain.token_ids[:2]).strip()]}, None)]
    for fields, kwargs in cases:
        kwargs = fields if kwargs is None else kwargs
        want = offline(llm, chat, logprobs=0, **kwargs)
        assert want.token_ids != plain.token_ids, fields  # the field changes the answer
        text, logprobs = served(client, chat, **json.loads(json.dumps(fields)))
        assert text == want.text, fields
        assert logprobs == pytest.approx([e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-5)


@pytest.mark.parametrize("fields, words", [
    ({"logit_bias": {"5": 150}}, ["logit_bias", "[-100, 100]", "5: 150"]),
    ({"logit_bias": {"5": -100.5, "6": 1}}, ["logit_bias", "5: -100.5"]),
    ({"logit_bias": {"abc": 1, "-3": 2, "7": 1}}, ["logit_bias", "'abc'", "'-3'"]),
    ({"logit_bias": {"4096": 1, "99999": 2}}, ["vocabulary", "[4096, 99999] in logit_bias"]),
    ({"logit_bias": {"5": "1"}}, ["logit_bias"]),
    ({"allowed_token_ids": []}, ["allowed_token_ids", "empty"]),
    ({"allowed_token_ids": [3, 5000]}, ["[5000] in allowed_token_ids"]),
    ({"allowed_token_ids": ["3"]}, ["allowed_token_ids"]),
    ({"bad_words": "hello"}, ["bad_words"]),
    ({"bad_words": ["   "]}, ["bad_words", "no token"]),
])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_values_are_a_400_that_names_them(client, fields, words, chat):
    with pytest.raises(openai.BadRequestError) as error:
        if chat:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=fields)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=fields)
    message = error.value.body["message"] if isinstance(error.value.body, dict) else str(error.value)
    for word in words:
        assert word in message, message
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None


# ---------------------------------------------------------------------------------------------
# No answer carries a non-finite float (chapter 13's grammars make -inf logprobs)
# ---------------------------------------------------------------------------------------------


@pytest.mark.ch13
def test_the_issue_case_chat_top_logprobs_under_a_choice_grammar(client):
    pytest.importorskip("xgrammar")
    choices = ["yes", "no", "maybe"]
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=5,
                                            extra_body={"structured_outputs": {"choice": choices}}, max_tokens=8)
    assert answer.choices[0].message.content in choices
    values = [t.logprob for t in answer.choices[0].logprobs.content]
    values += [alt.logprob for t in answer.choices[0].logprobs.content for alt in t.top_logprobs]
    assert all(math.isfinite(v) and v >= LOWEST_LOGPROB for v in values)
    assert LOWEST_LOGPROB in values  # fewer than 5 tokens are allowed: forbidden ones fill the top 5


@pytest.mark.ch13
def test_the_grammar_and_the_bias_apply_together(llm):
    """The grammar decides what may come, the bias which of it: a bias for the first token of
    another choice picks it, and a bias for a token the grammar forbids changes nothing. A
    whitelist disjoint from what the grammar allows leaves no token: the grammar's rule wins
    (worker/logit_bias.py), and the answer is still one of the choices."""
    pytest.importorskip("xgrammar")
    tokenizer = llm.get_tokenizer()
    grammar = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    plain = offline(llm, False, structured_outputs=grammar).text
    assert plain in ("yes", "no", "maybe")
    target = next(c for c in ("maybe", "no", "yes") if c != plain)
    first = tokenizer.encode(target, add_special_tokens=False)[0]
    assert offline(llm, False, structured_outputs=grammar, logit_bias={first: 30.0}).text == target
    outside = tokenizer.encode(" def", add_special_tokens=False)[0]
    assert offline(llm, False, structured_outputs=grammar, logit_bias={outside: 100.0}).text == plain
    assert offline(llm, False, structured_outputs=grammar, allowed_token_ids=[outside]).text == plain
    assert offline(llm, False, structured_outputs=grammar, bad_words=[plain]).text in ("yes", "no", "maybe")


@pytest.mark.ch13
@pytest.mark.slow
def test_no_answer_body_carries_a_non_finite_float(llm):
    """A property over grammars, penalties, biases, whitelists and bad words, sampled or greedy:
    the completions and chat bodies built from the outputs (logprobs with alternatives, prompt
    logprobs) are valid JSON, which has no -inf or NaN."""
    pytest.importorskip("xgrammar")
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
