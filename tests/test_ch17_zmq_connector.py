"""Chapter 17's second connector: KV blocks between processes over ZMQ. A producer serves the
blocks it saved; a consumer (its engine core in a process of its own, or not) fetches them and
gives transformers' greedy tokens, the fetched tokens counted and never computed; a consumer whose
producer is down computes everything itself, in bounded time; the config names a bad field."""
from __future__ import annotations

import socket
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.config.engine import EngineConfig
from tiny_models import random_prompts

pytestmark = [pytest.mark.ch17, pytest.mark.floors, pytest.mark.timeout(240)]

GREEDY = {"temperature": 0.0, "ignore_eos": True}
BLOCK = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zmq_config(role: str, port: int) -> dict:
    return {"kv_connector": "ZmqConnector", "kv_role": role,
            "kv_connector_extra_config": {"kv_host": "127.0.0.1", "kv_port": port}}


@pytest.mark.parametrize("extra, field", [
    ({"kv_host": "127.0.0.1"}, "['kv_port'] is required"),
    ({"kv_host": "127.0.0.1", "kv_port": 0}, "['kv_port'] must be an integer >= 1 and <= 65535"),
    ({"kv_host": "127.0.0.1", "kv_port": "5555"}, "['kv_port'] must be an integer"),
    ({"kv_host": "", "kv_port": 5555}, "['kv_host'] must be a non-empty str"),
    ({"kv_host": "127.0.0.1", "kv_port": 5555, "kv_buffer_blocks": True}, "['kv_buffer_blocks'] must be an integer"),
])
def test_a_bad_zmq_config_names_the_field(extra, field):
    with pytest.raises(ValueError) as err:
        EngineConfig(kv_transfer_config={"kv_connector": "ZmqConnector", "kv_role": "kv_both",
                                         "kv_connector_extra_config": extra})
    assert field in str(err.value), f"{extra}: the error should name {field!r}, got: {err.value}"


@pytest.mark.parametrize("multiprocess", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_consumer_fetches_the_producers_blocks(hf_models, reference, multiprocess):
    """multiprocess: the consumer's engine core in a process of its own (chapter 15), so the
    blocks cross between processes; without it, they still go through the socket."""
    hf = hf_models["llama"]
    port = free_port()
    prompts = random_prompts([6, 13, 22, 9], seed=4)
    settings = {"device": "cpu", "block_size": BLOCK, "max_num_batched_tokens": 8}
    producer = LLM(hf, kv_transfer_config=zmq_config("kv_producer", port), **settings)
    producer.generate(prompts[:3], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    consumer = LLM(hf, multiprocess=multiprocess, kv_transfer_config=zmq_config("kv_consumer", port), **settings)
    try:
        outputs = consumer.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    finally:
        consumer.shutdown()
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.outputs[0].token_ids == reference(hf, prompt, 6), f"prompt {i}: differs from transformers"
    assert [o.num_cached_tokens for o in outputs] == [4, 12, 20, 0], \
        "the full blocks before each produced prompt's last token were fetched; the fourth was never produced"


def test_a_consumer_whose_producer_is_down_computes_everything(hf_models, reference):
    hf = hf_models["qwen2"]
    prompts = random_prompts([10, 17, 25], seed=6)
    consumer = LLM(hf, device="cpu", block_size=BLOCK, kv_transfer_config=zmq_config("kv_consumer", free_port()))
    start = time.monotonic()
    outputs = consumer.generate(prompts, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert time.monotonic() - start < 30, "one lookup waits for the producer; the others count as misses at once"
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.outputs[0].token_ids == reference(hf, prompt, 5), f"prompt {i}: differs from transformers"
        assert out.num_cached_tokens == 0
