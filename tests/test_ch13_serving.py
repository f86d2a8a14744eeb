"""Chapter 13 over HTTP, through the official openai client: OpenAI's response_format
(json_object, json_schema) and vLLM's structured_outputs (json, regex, choice, grammar, through
extra_body) on both endpoints give what LLM.generate gives with the same constraint, streamed
or whole; malformed or meaningless constraints get a 400 with OpenAI's error body, and the
server keeps serving. The server runs in a thread on 127.0.0.1, on the embedded model."""
from __future__ import annotations

import json
import re
import threading
import time

import openai
import pytest

from minivllm import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from minivllm.structured_outputs import backend
from minivllm.entrypoints.openai import threaded

pytestmark = [pytest.mark.ch13, pytest.mark.floors]
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny-structured"
ENGINE = dict(num_kv_blocks=256, max_num_seqs=32)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "port": {"type": "integer", "minimum": 1,
                                                                               "maximum": 65535}},
          "required": ["name", "port"]}
PROMPT = "SERVER = "
MESSAGES = [{"role": "user", "content": "Give me the server's config as JSON."}]
TIMEOUT = 60


@pytest.fixture(scope="module")
def llm(default_model, chat_tokenizer) -> LLM:
    return LLM(default_model, tokenizer=chat_tokenizer, **ENGINE)


@pytest.fixture(scope="module")
def client(default_model, chat_tokenizer):
    with threaded.running_server(LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE), MODEL) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def expected(llm: LLM, prompt, constraint: StructuredOutputsParams, max_tokens: int = 64):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    if isinstance(prompt, list):
        return llm.chat(prompt, params, use_tqdm=False)[0].outputs[0]
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_response_format_json_schema_on_both_endpoints(client, llm):
    constraint = StructuredOutputsParams(json=SCHEMA)
    response_format = {"type": "json_schema", "json_schema": {"name": "config", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                          response_format=response_format)
    want = expected(llm, MESSAGES, constraint)
    assert chat.choices[0].message.content == want.text and chat.choices[0].finish_reason == want.finish_reason
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0,
                                           extra_body={"response_format": response_format})
    want = expected(llm, PROMPT, constraint)
    assert completion.choices[0].text == want.text and want.finish_reason == "stop"
    jsonschema.validate(json.loads(want.text), SCHEMA)


def test_response_format_json_object_and_text(client, llm):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                          response_format={"type": "json_object"})
    want = expected(llm, MESSAGES, StructuredOutputsParams(json_object=True))
    assert chat.choices[0].message.content == want.text and want.text.startswith("{")
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"response_format": {"type": "text"}})
    assert plain.choices[0].text == llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8),
                                                 use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("field, value", [
    ("json", SCHEMA), ("json", json.dumps(SCHEMA)), ("regex", r"[a-z]{1,8}:[0-9]{2,4}"), ("choice", ["on", "off"]),
    ("grammar", 'root ::= "port=" [0-9]+'),
])
def test_structured_outputs_through_extra_body(client, llm, field, value):
    constraint = StructuredOutputsParams(**{field: value})
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0,
                                           extra_body={"structured_outputs": {field: value}})
    assert completion.choices[0].text == expected(llm, PROMPT, constraint).text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
                                          extra_body={"structured_outputs": {field: value}})
    assert chat.choices[0].message.content == expected(llm, MESSAGES, constraint).text


def test_a_constrained_stream_adds_up_to_the_whole_answer(client):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0,
                extra_body={"structured_outputs": {"regex": r"[a-z]{1,8}:[0-9]{2,4}"}})
    whole = client.completions.create(**body).choices[0]
    chunks = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert re.fullmatch(r"[a-z]{1,8}:[0-9]{2,4}", whole.text) and chunks[-1].choices[0].finish_reason == "stop"


def test_the_server_default_for_whitespace_and_a_request_that_overrides_it(client, llm):
    spaced = {"json": SCHEMA, "disable_any_whitespace": False}
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                           extra_body={"structured_outputs": spaced})
    want = expected(llm, PROMPT, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False), 16)
    compact = expected(llm, PROMPT, StructuredOutputsParams(json=SCHEMA), 16)
    assert completion.choices[0].text == want.text != compact.text


@pytest.mark.parametrize("endpoint, extra, message", [
    ("completions", {"structured_outputs": {"json": {"type": "foo"}}}, "invalid structured_outputs.json"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "invalid structured_outputs.regex"),
    ("completions", {"structured_outputs": {"grammar": "root ::="}}, "invalid structured_outputs.grammar"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ("completions", {"structured_outputs": {}}, "exactly one"),
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ("completions", {"structured_outputs": {"jsn": {}}}, "unknown or unsupported field"),
    ("completions", {"structured_outputs": {"json": {"allOf": []}}}, "does not enforce"),
    ("chat", {"response_format": {"type": "json_schema"}}, "json_schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs a schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ("chat", {"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
])
def test_bad_constraints_get_a_400_and_the_server_keeps_serving(client, endpoint, extra, message):
    with pytest.raises(openai.BadRequestError, match=message) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body=extra)
    assert info.value.status_code == 400 and info.value.body["type"] == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text is not None


def test_a_request_waiting_for_its_grammar_counts_as_waiting(default_model, chat_tokenizer, monkeypatch):
    """max_waiting=1: while one request's grammar compiles (held here), the next request is a 503."""
    release = threading.Event()
    compile_grammar = backend.XgrammarBackend.compile_grammar
    monkeypatch.setattr(backend.XgrammarBackend, "compile_grammar",
                        lambda self, grammar: release.wait(timeout=60) and compile_grammar(self, grammar))
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    with threaded.running_server(engine, MODEL, max_waiting=1) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        answers, errors = [], []

        def ask() -> None:
            try:
                answers.append(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                                         extra_body={"structured_outputs": {"choice": ["on", "off"]}}))
            except openai.APIError as error:  # shown below: in a student copy, the 500 names the stub
                errors.append(error)

        first = threading.Thread(target=ask)
        first.start()
        try:
            deadline = time.monotonic() + 30
            while not engine.core.scheduler.waiting_for_grammar and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.core.scheduler.waiting_for_grammar, "the first request never reached the engine"
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert info.value.status_code == 503
        finally:
            release.set()
            first.join(TIMEOUT)
        assert not errors, f"the constrained request failed: {errors[0]}"
        assert answers and answers[0].choices[0].text in ("on", "off")


def test_serve_flag_sets_the_whitespace_default(tiny_checkpoint):
    from minivllm.entrypoints.cli import build_parser, engine_options

    def options(*flags: str) -> dict:
        return engine_options(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), *flags]))

    assert options()["disable_any_whitespace"] is None
    assert options("--no-disable-any-whitespace")["disable_any_whitespace"] is False
    engine = LLMEngine(str(tiny_checkpoint), **options("--no-disable-any-whitespace", "--device", "cpu"))
    assert engine.config.disable_any_whitespace is False
    assert LLMEngine(str(tiny_checkpoint), **options("--device", "cpu")).config.disable_any_whitespace is True


def guided(client, max_tokens: int, **fields) -> str:
    """A completion of PROMPT under vLLM's older guided_* fields (issue 36), sent as extra fields."""
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, temperature=fields.pop(
        "temperature", 0), extra_body=fields).choices[0].text


def test_older_guided_names_are_structured_outputs(client):
    assert guided(client, 4, guided_choice=["yes", "no"]) in {"yes", "no"}
    text = guided(client, 8, guided_regex="[0-9]{3}")
    assert len(text) == 3 and text.isdigit()
    value = json.loads(guided(client, 24, guided_json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                       "required": ["a"]}))
    assert isinstance(value["a"], int)


def test_json_schema_string_lengths_hold_and_the_output_stays_json(client):
    """minLength/maxLength become a pattern of unescaped characters (xgrammar's own admit raw
    control characters, which JSON forbids): sampled outputs parse and respect the lengths."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 5},
                                               "tag": {"type": "string", "maxLength": 1}}, "required": ["name", "tag"]}
    for seed in range(6):
        text = guided(client, 40, guided_json=schema, temperature=1.0, seed=seed)
        value = json.loads(text)
        assert 2 <= len(value["name"]) <= 5 and len(value["tag"]) <= 1, text
