"""Chapter 17 online: `minivllm disagg-proxy` in front of a producer and a consumer sharing a
folder. The official openai client's stream through the proxy equals offline greedy output, the
consumer loaded the prompt the producer computed, and an instance that is down is the client's
error at once (502), not a hang."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
import uvicorn
from server_checks import ENGINE, MODEL, openai_client, running_server

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.entrypoints.cli import build_parser
from minivllm.entrypoints.disagg_proxy import build_proxy, prefill_body

pytestmark = [pytest.mark.ch17, pytest.mark.floors, pytest.mark.timeout(240)]

PROMPTS = ["import os\n\ndef list_files(path):\n    return os.listdir(path)\n\n\ndef read_file(path):\n    with",
           "class Stack:\n    def push(self, item):\n        self."]


@contextmanager
def running_proxy(prefill: str, decode: str) -> Iterator[str]:
    """The proxy served by uvicorn in a thread on 127.0.0.1 (a port the OS picks); yields its url."""
    server = uvicorn.Server(uvicorn.Config(build_proxy(prefill, decode), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def transfer(role: str, folder) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(folder)}}


def test_the_prefill_request_is_one_token_and_no_stream():
    body = {"model": "m", "prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0}
    assert prefill_body(body) == {"model": "m", "prompt": "x", "max_tokens": 1, "stream": False, "temperature": 0}
    args = build_parser().parse_args(["disagg-proxy", "--prefill", "http://a:1", "--decode", "http://b:2"])
    assert (args.prefill, args.decode, args.host) == ("http://a:1", "http://b:2", "127.0.0.1")


def test_the_proxy_streams_the_consumers_greedy_answer(default_model, chat_tokenizer, tmp_path):
    settings = dict(tokenizer=chat_tokenizer, enable_prefix_caching=False, **ENGINE)
    producer = LLMEngine(default_model, kv_transfer_config=transfer("kv_producer", tmp_path), **settings)
    consumer = LLMEngine(default_model, kv_transfer_config=transfer("kv_consumer", tmp_path), **settings)
    loaded: list[int] = []
    update = consumer.core.connector.update_state_after_alloc
    consumer.core.connector.update_state_after_alloc = lambda seq, n: (loaded.append(n), update(seq, n))[1]
    offline = LLM(default_model, **settings)
    with running_server(producer) as (prefill_url, _), running_server(consumer) as (decode_url, _), \
            running_proxy(prefill_url, decode_url) as proxy:
        client = openai_client(proxy)
        for prompt in PROMPTS:
            expected = offline.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)[0]
            chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                    stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
            whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
            assert whole.choices[0].text == expected.outputs[0].text
        block = ENGINE.get("block_size", 16)
        assert loaded and all(n % block == 0 and n > 0 for n in loaded), \
            f"the consumer should have loaded the prompts' full blocks from the producer: {loaded}"
        with pytest.raises(openai.BadRequestError):  # the prefill's verdict on a bad request reaches the client
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=-1)
    for alive, dead in ((consumer, "prefill"), (producer, "decode")):  # the other one's port no longer answers
        with running_server(alive) as (url, _):
            urls = (prefill_url, url) if dead == "prefill" else (url, decode_url)
            with running_proxy(*urls) as proxy:
                start = time.monotonic()
                with pytest.raises(openai.InternalServerError) as err:
                    openai_client(proxy).completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, stream=True)
                assert err.value.status_code == 502 and dead in str(err.value), err.value
                assert time.monotonic() - start < 5, f"the {dead} instance is down: the client must hear it at once"
