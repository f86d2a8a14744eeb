"""Chapter 17: disaggregated prefill through a KV connector. The config's checks name the field;
the consumer's lookup (exercise 17.1) against hand-made files; the producer's blocks equal
transformers' own K and V; and a producer (max_tokens=1) then a consumer give transformers'
greedy tokens on two model families, with chunked prefill, prefix caching on either side,
prompts never produced, preemption on the consumer, and the loaded tokens never computed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm import LLM, SamplingParams
from minivllm.config.engine import EngineConfig
from minivllm.config.kv_transfer import KVTransferConfig
from minivllm.kv_transfer import KVConnectorRole, KVLayout
from minivllm.kv_transfer.shared_storage import SharedStorageConnector, prefix_keys
from minivllm.request.sequence import Sequence
from tiny_models import random_prompts

pytestmark = [pytest.mark.ch17, pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)
BLOCK = 4


def transfer(role: str, folder: Path) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(folder)}}


@pytest.mark.parametrize("config, field", [
    ("SharedStorageConnector", "kv_transfer_config must be a dict"),
    ({"kv_role": "kv_both"}, "'kv_connector'"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_transfer_config['kv_connector']"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "producer",
      "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}}, "kv_transfer_config['kv_role']"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}, "['shared_storage_path'] is required"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"shared_storage_path": 3}}, "['shared_storage_path'] must be a non-empty str"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"shared_storage_path": "/tmp/x", "path": "/tmp/y"}}, "unknown keys ['path']"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_buffer_size": 1}, "unknown keys"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", "kv_connector_extra_config": []},
     "['kv_connector_extra_config'] must be a dict"),
])
def test_a_bad_kv_transfer_config_names_the_field(config, field):
    with pytest.raises(ValueError) as err:
        EngineConfig(kv_transfer_config=config)
    assert field in str(err.value), f"{config!r}: the error should name {field!r}, got: {err.value}"


def test_kv_transfer_needs_one_rank(tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(kv_transfer_config=transfer("kv_both", tmp_path), tensor_parallel_size=2)
    assert EngineConfig(kv_transfer_config=transfer("kv_both", tmp_path)).kv_transfer_config.is_consumer


# ---- exercise 17.1: the consumer's lookup ----

LAYOUT = KVLayout(num_layers=1, block_size=BLOCK, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def storage(tmp_path: Path, role: str = "kv_consumer") -> SharedStorageConnector:
    return SharedStorageConnector(KVTransferConfig.from_dict(transfer(role, tmp_path)), KVConnectorRole.SCHEDULER, LAYOUT)


def put_blocks(connector: SharedStorageConnector, tokens: list[int], which: list[int]) -> None:
    """Files for the blocks `which` of `tokens`' prefix (their content does not matter to the lookup)."""
    keys = prefix_keys(tokens, BLOCK)
    for i in which:
        save_file({"k": torch.zeros(1, BLOCK, 1, 2), "v": torch.zeros(1, BLOCK, 1, 2)}, connector.path(keys[i]))


def request(tokens: list[int], **params) -> Sequence:
    return Sequence("r", tokens, SamplingParams(max_tokens=4, **params), max_model_len=1000)


def test_get_num_new_matched_tokens_counts_leading_full_prompt_blocks(tmp_path):
    connector = storage(tmp_path)
    tokens = list(range(1, 15))  # 14 tokens: 3 full blocks of 4 and 2 more
    cases = [  # (blocks with a file, tokens already computed here, expected)
        ([], 0, 0, "no file: nothing to load"),
        ([0], 0, 4, "the first block"),
        ([0, 1, 2], 0, 12, "every full block"),
        ([0, 2], 0, 4, "a gap: block 2 is useless without block 1"),
        ([1, 2], 0, 0, "no first block: nothing"),
        ([0, 1, 2], 4, 8, "after 4 tokens the prefix cache found: only the rest"),
        ([0, 1], 8, 0, "the prefix cache has all the files have"),
        ([0], 8, 0, "the prefix cache has more than the files: never negative"),
    ]
    for which, computed, expected, case in cases:
        for old in tmp_path.rglob("*.safetensors"):
            old.unlink()
        put_blocks(connector, tokens, which)
        files = sorted(tmp_path.rglob("*"))
        got = connector.get_num_new_matched_tokens(request(tokens), computed)
        assert got == expected, f"{case}: files for blocks {which}, {computed} computed: expected {expected}, got {got}"
        assert sorted(tmp_path.rglob("*")) == files, "the lookup reads only"


def test_get_num_new_matched_tokens_leaves_the_last_token_to_compute(tmp_path):
    connector = storage(tmp_path)
    tokens = list(range(1, 13))  # exactly 3 full blocks: the last token's block is full, yet it must run here
    put_blocks(connector, tokens, [0, 1, 2])
    got = connector.get_num_new_matched_tokens(request(tokens), 0)
    assert got == 8, f"a 12-token prompt with 3 blocks stored: load 8, compute the last block for its logits; got {got}"
    assert connector.get_num_new_matched_tokens(request(tokens[:3]), 0) == 0, "a prompt shorter than a block: 0"
    # After a preemption a request holds output tokens too: still only its prompt's blocks were produced.
    resumed = request(tokens)
    resumed.token_ids += [50, 51, 52, 53, 54]
    got = connector.get_num_new_matched_tokens(resumed, 0)
    assert got == 12, f"a preempted request with 5 outputs: all 3 prompt blocks (its last token is an output), got {got}"


def test_get_num_new_matched_tokens_is_a_consumers_and_skips_prompt_logprobs(tmp_path):
    tokens = list(range(1, 15))
    producer = storage(tmp_path, "kv_producer")
    put_blocks(producer, tokens, [0, 1, 2])
    assert producer.get_num_new_matched_tokens(request(tokens), 0) == 0, "a producer loads nothing"
    consumer = storage(tmp_path, "kv_consumer")
    assert consumer.get_num_new_matched_tokens(request(tokens, prompt_logprobs=1), 0) == 0, \
        "a request that asked for prompt logprobs needs every prompt token's logits: it loads nothing"
    assert storage(tmp_path, "kv_both").get_num_new_matched_tokens(request(tokens), 0) == 12


# ---- the producer's save, against transformers ----

def test_the_producer_saves_transformers_k_and_v(tmp_path, hf_models):
    hf = hf_models["qwen3"]
    llm = LLM(hf, device="cpu", block_size=BLOCK, max_num_batched_tokens=6,
              kv_transfer_config=transfer("kv_producer", tmp_path))
    prompt = random_prompts([11], seed=3)[0]  # 2 full blocks, in chunks of 6 (a block split across steps)
    llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 2, f"11 tokens in blocks of {BLOCK}: 2 full blocks saved (the partial third is not), got {files}"
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    keys = prefix_keys(prompt, BLOCK)
    for i, key in enumerate(keys):
        block = load_file(next(f for f in files if f.stem == key))
        for layer in range(hf.config.num_hidden_layers):
            for name, theirs in (("k", cache.layers[layer].keys), ("v", cache.layers[layer].values)):
                expected = theirs[0, :, i * BLOCK:(i + 1) * BLOCK].transpose(0, 1)  # [block, kv_heads, head_dim]
                torch.testing.assert_close(block[name][layer], expected, atol=1e-5, rtol=1e-5,
                                           msg=lambda m, i=i, layer=layer, name=name: f"block {i}, layer {layer}, {name}: {m}")


# ---- producer then consumer: exact, and the loaded tokens not computed ----

def record_chunks(llm: LLM) -> dict[str, list[tuple[int, int]]]:
    """Every chunk each request computes, as the model runner receives them: request id ->
    [(first position, tokens), ...]."""
    chunks: dict[str, list[tuple[int, int]]] = {}
    runner = llm.engine.core.runner
    run = runner.run

    def counting(schedule, *args):
        for seq, n in zip(schedule.seqs, schedule.num_new_tokens):
            chunks.setdefault(seq.request_id, []).append((seq.num_computed_tokens, n))
        return run(schedule, *args)

    runner.run = counting
    return chunks


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("producer_caching, consumer_caching", [(True, True), (False, False), (False, True)])
def test_producer_then_consumer_equals_transformers(tmp_path, hf_models, reference, family, producer_caching,
                                                    consumer_caching):
    hf = hf_models[family]
    shared = random_prompts([13], seed=7)[0]
    produced = random_prompts([3, 9, 16, 21, 30], seed=1) + [shared + [5, 6, 7], shared + [8, 9, 10, 11, 12]]
    never = random_prompts([10, 18], seed=2)  # the consumer meets these first: it computes them itself
    settings = dict(device="cpu", block_size=BLOCK, max_num_batched_tokens=8)  # every prompt above 8 is chunked
    producer = LLM(hf, enable_prefix_caching=producer_caching, kv_transfer_config=transfer("kv_producer", tmp_path),
                   **settings)
    producer.generate(produced, SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    consumer = LLM(hf, enable_prefix_caching=consumer_caching, kv_transfer_config=transfer("kv_consumer", tmp_path),
                   **settings)
    chunks = record_chunks(consumer)
    prompts = produced + never
    outputs = consumer.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    one_engine = LLM(hf, **settings).generate(prompts, SamplingParams(max_tokens=6, **GREEDY), use_tqdm=False)
    for i, (prompt, out, alone) in enumerate(zip(prompts, outputs, one_engine)):
        expected = reference(hf, prompt, 6)
        assert alone.outputs[0].token_ids == expected, f"prompt {i}: one engine differs from transformers"
        assert out.outputs[0].token_ids == expected, \
            f"prompt {i} ({len(prompt)} tokens): the consumer's tokens differ from transformers'"
        stored = (len(prompt) - 1) // BLOCK * BLOCK if i < len(produced) else 0
        # Loaded or found in the consumer's own prefix cache (the two shared-prefix prompts share 3 blocks).
        assert out.num_cached_tokens == stored, \
            f"prompt {i} ({len(prompt)} tokens): {stored} tokens stored by the producer, num_cached_tokens={out.num_cached_tokens}"
        must_compute = len(prompt) - stored + 6 - 1  # the rest of the prompt, then a decode per output but the last
        mine = chunks[out.request_id]
        assert mine[0][0] == stored and sum(n for _, n in mine) == must_compute, \
            f"prompt {i}: {stored} of {len(prompt)} tokens loaded, so {must_compute} computed from position {stored}; " \
            f"got chunks (start, tokens) {mine}"


def test_a_preempted_consumer_request_fetches_its_prompt_again(tmp_path, hf_models, reference):
    """The choice for preemption on the consumer: recompute-preemption as everywhere, and on
    re-admission the lookup runs again, so the prompt's blocks are loaded again from storage (they
    stay there) and only the rest is recomputed."""
    hf = hf_models["qwen3"]
    prompts = random_prompts([17, 21, 25, 19], seed=5)
    settings = dict(device="cpu", block_size=BLOCK, max_num_batched_tokens=32, enable_prefix_caching=False)
    LLM(hf, kv_transfer_config=transfer("kv_producer", tmp_path), **settings).generate(
        prompts, SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    # 14 blocks of 4: the four prompts need 5-7 blocks each to start, and 20 more tokens each to finish.
    consumer = LLM(hf, num_kv_blocks=14, kv_transfer_config=transfer("kv_consumer", tmp_path), **settings)
    chunks = record_chunks(consumer)
    outputs = consumer.generate(prompts, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    assert sum(out.metrics.num_preemptions for out in outputs) > 0, "the pool was meant to force a preemption"
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.outputs[0].token_ids == reference(hf, prompt, 20), f"prompt {i}: differs from transformers"
        stored = (len(prompt) - 1) // BLOCK * BLOCK
        assert out.num_cached_tokens == stored, f"prompt {i}: counted on its first admission, as prefix-cache hits are"
        mine = chunks[out.request_id]
        assert min(start for start, _ in mine) >= stored, \
            f"prompt {i}: its first {stored} tokens are loaded, at every admission; chunks (start, tokens) {mine}"
        if out.metrics.num_preemptions == 0:
            assert sum(n for _, n in mine) == len(prompt) - stored + 19


def test_kv_both_loads_what_exists_and_saves_what_it_computes(tmp_path, hf_models, reference):
    hf = hf_models["qwen3"]
    prompts = random_prompts([14, 23], seed=9)
    settings = dict(device="cpu", block_size=BLOCK, enable_prefix_caching=False)
    first = LLM(hf, kv_transfer_config=transfer("kv_both", tmp_path), **settings)
    out = first.generate(prompts[:1], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    assert out[0].num_cached_tokens == 0
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3, "14 tokens: 3 full blocks saved"
    second = LLM(hf, kv_transfer_config=transfer("kv_both", tmp_path), **settings)
    outs = second.generate(prompts, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [12, 0], "the first prompt's 3 blocks loaded, the second's computed"
    assert len(list(tmp_path.rglob("*.safetensors"))) == 3 + 5, "and the second's 5 full blocks saved"
    for prompt, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(hf, prompt, 5)


def test_a_consumer_with_async_scheduling_loads_the_same(tmp_path, hf_models, reference):
    """Chapter 16's overlap plans step N+1 before step N's tokens are read: the loads of a request
    admitted in N+1 still land before N+1's forward."""
    hf = hf_models["qwen3"]
    prompts = random_prompts([9, 22, 15, 30], seed=11)
    settings = {"device": "cpu", "block_size": BLOCK, "max_num_batched_tokens": 12}
    LLM(hf, kv_transfer_config=transfer("kv_producer", tmp_path), **settings).generate(
        prompts[:3], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    consumer = LLM(hf, async_scheduling=True, kv_transfer_config=transfer("kv_consumer", tmp_path), **settings)
    outputs = consumer.generate(prompts, SamplingParams(max_tokens=7, **GREEDY), use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.outputs[0].token_ids == reference(hf, prompt, 7), f"prompt {i}: differs from transformers"
    assert [o.num_cached_tokens for o in outputs] == [8, 20, 12, 0]


def test_serve_takes_a_kv_transfer_config(tmp_path):
    from minivllm.entrypoints.cli import build_parser, engine_options

    config = transfer("kv_consumer", tmp_path)
    options = engine_options(build_parser().parse_args(["serve", "--kv-transfer-config", json.dumps(config)]))
    assert options["kv_transfer_config"] == config
    assert EngineConfig(kv_transfer_config=options["kv_transfer_config"]).kv_transfer_config.is_consumer
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-transfer-config", "SharedStorageConnector"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("connector", ["SharedStorageConnector", "ZmqConnector"])
def test_on_a_gpu_the_consumer_equals_transformers_with_every_switch_on(tmp_path, hf_models, reference, connector):
    """On CUDA in fp32 with the GPU defaults (Triton attention, decode graphs, piecewise graphs,
    fused ops, async scheduling): the loads land in the pool the graphs read, before the replay."""
    import socket

    from minivllm import load_model

    hf = hf_models["qwen3"]
    if connector == "ZmqConnector":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = {"kv_host": "127.0.0.1", "kv_port": port}
    else:
        extra = {"shared_storage_path": str(tmp_path)}
    config = {"kv_connector": connector, "kv_connector_extra_config": extra}
    model = load_model(hf, device="cuda", dtype=torch.float32)
    prompts = random_prompts([9, 30, 17, 64, 5], seed=12)
    settings = {"block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 32}
    LLM(model, kv_transfer_config=config | {"kv_role": "kv_producer"}, **settings).generate(
        prompts[:4], SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)
    consumer = LLM(model, kv_transfer_config=config | {"kv_role": "kv_consumer"}, **settings)
    outputs = consumer.generate(prompts, SamplingParams(max_tokens=12, **GREEDY), use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.outputs[0].token_ids == reference(hf, prompt, 12), f"prompt {i}: differs from transformers"
    assert [o.num_cached_tokens for o in outputs] == [0, 16, 16, 48, 0]
