"""Issue 49 over HTTP, through the official openai client: `logit_bias` (OpenAI's), and vLLM's
`allowed_token_ids` and `bad_words` (through extra_body) on /v1/completions and
/v1/chat/completions give what LLM.generate gives with the same SamplingParams; bad values are a
400 that names them. (With grammars, and the logprob floor: test_ch13_logit_bias.py.)"""
from __future__ import annotations

import json

import openai
import pytest
from server_checks import MODEL, openai_client, running_server

from minivllm import LLM, LLMEngine, SamplingParams

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
