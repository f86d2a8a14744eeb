"""Issue 49: vLLM's chat request fields that shape the chat template's rendering, on
/v1/chat/completions (through the official openai client's extra_body), its batch route and
/tokenize: `chat_template_kwargs` (variables for the template, such as enable_thinking; one the
template does not read changes nothing), `documents` (for templates that render them) and
`chat_template` (a request's own template: Jinja the server runs, so refused unless the server
was started with --trust-request-chat-template, vLLM's rule). The reference is transformers'
own apply_chat_template on an independently loaded tokenizer; bad values are a 400 naming them."""
from __future__ import annotations

import httpx
import pytest
from server_checks import MODEL, TIMEOUT, answer, openai_client, running_server
from transformers import AutoTokenizer

import minivllm
from minivllm import DEFAULT_MODEL, LLMEngine

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8}
# A template that reads documents and enable_thinking, as RAG and reasoning models' templates do.
TEMPLATE = ("{% for d in documents or [] %}[doc {{ d['title'] }}: {{ d['text'] }}]\n{% endfor %}"
            "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}# assistant:{% if enable_thinking %} <think>{% endif %}{% endif %}")
OTHER = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}<answer>"
MESSAGES = [{"role": "user", "content": "What is in the box?"}]
DOCUMENTS = [{"title": "box", "text": "a cat"}, {"title": "shelf", "text": "two books"}]


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer of the embedded model, loaded on its own, with TEMPLATE."""
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def expected(reference, template: str | None = None, **kwargs) -> list[int]:
    text = reference.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True,
                                         **kwargs)
    return reference.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module", params=[False, True], ids=["untrusted", "trusted"])
def server(request, default_model):
    tokenizer = minivllm.load_tokenizer()  # its own copy: the template is this module's
    tokenizer.chat_template = TEMPLATE
    engine = LLMEngine(default_model, tokenizer=tokenizer, **ENGINE)
    with running_server(engine, trust_request_chat_template=request.param) as (url, _), \
            httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        yield request.param, http, openai_client(url)


def chat_prompt_ids(api, **fields) -> list[int]:
    answer = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0,
                                         extra_body=fields | {"return_token_ids": True})
    return answer.prompt_token_ids


def tokenized(http, **fields) -> list[int]:
    return answer(http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES} | fields))["tokens"]


def test_template_kwargs_and_documents_render_as_transformers_renders_them(server, reference):
    _, http, api = server
    plain = expected(reference)
    cases = [({"chat_template_kwargs": {"enable_thinking": True}}, expected(reference, enable_thinking=True)),
             ({"documents": DOCUMENTS}, expected(reference, documents=DOCUMENTS)),
             ({"chat_template_kwargs": {"enable_thinking": True}, "documents": DOCUMENTS},
              expected(reference, enable_thinking=True, documents=DOCUMENTS)),
             ({"chat_template_kwargs": {"not_read_by_the_template": 1}}, plain)]
    for fields, ids in cases:
        assert ids != plain or "not_read_by_the_template" in str(fields)  # each case changes the prompt
        assert chat_prompt_ids(api, **fields) == ids, fields
        assert tokenized(http, **fields) == ids, fields
    batch = answer(http.post("/v1/chat/completions/batch", json={
        "model": MODEL, "messages": [MESSAGES, MESSAGES], "max_tokens": 1, "return_token_ids": True,
        "documents": DOCUMENTS}))
    assert batch["usage"]["prompt_tokens"] == 2 * len(expected(reference, documents=DOCUMENTS))


def test_a_request_template_runs_only_on_a_server_that_trusts_it(server, reference):
    trusted, http, api = server
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "chat_template": OTHER}
    if trusted:
        assert chat_prompt_ids(api, chat_template=OTHER) == expected(reference, OTHER)
        assert tokenized(http, chat_template=OTHER) == expected(reference, OTHER)
        return
    for path, sent in (("/v1/chat/completions", body), ("/tokenize", body | {"max_tokens": None})):
        response = http.post(path, json={k: v for k, v in sent.items() if v is not None})
        assert response.status_code == 400, response.text
        assert "--trust-request-chat-template" in response.text and response.json()["error"]["param"] == "chat_template"


def test_bad_values_are_a_400_that_names_them(server):
    _, http, _ = server
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    cases = [("/v1/chat/completions", chat | {"chat_template_kwargs": {"tokenize": True}}, "tokenize"),
             ("/v1/chat/completions", chat | {"chat_template_kwargs": {"add_generation_prompt": False}},
              "add_generation_prompt"),
             ("/tokenize", {"model": MODEL, "messages": MESSAGES, "chat_template_kwargs": {"chat_template": OTHER}},
              "chat_template"),
             ("/v1/chat/completions", chat | {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
             ("/v1/chat/completions", chat | {"documents": [{"title": 1}]}, "documents"),
             ("/tokenize", {"model": MODEL, "prompt": "x", "documents": DOCUMENTS}, "documents")]
    for path, body, words in cases:
        response = http.post(path, json=body)
        assert response.status_code == 400, (body, response.text)
        assert words in response.text, response.text


def test_llm_chat_takes_chat_template_kwargs(default_model, reference):
    """The offline LLM.chat (vLLM's keyword): the same prompt as transformers renders."""
    tokenizer = minivllm.load_tokenizer()
    tokenizer.chat_template = TEMPLATE
    llm = minivllm.LLM(default_model, tokenizer=tokenizer, **ENGINE)
    params = minivllm.SamplingParams(max_tokens=1, temperature=0)
    out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": True})[0]
    assert out.prompt_token_ids == expected(reference, enable_thinking=True) != expected(reference)
    with pytest.raises(ValueError, match="tokenize"):
        llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs={"tokenize": True})
