"""Chapter 14: tensor parallelism.

The exercises without processes (N ranks simulated by summing the shards' partial results); a
whole model's shards, N threads in lockstep, against transformers' logits; the step message
round trip; then the engine on N spawned processes: greedy tokens equal transformers' at N = 2
and 4 on the tiny Llama, Qwen2 (one KV head: replicated) and Qwen3 models, whose vocabulary of
97 no N divides, under starvation (tiny blocks, a pool that forces preemption, a small token
budget, chunked prefill) with prefix caching on; logprobs equal the one-process engine's within
fp32 rounding; the graph runner's path (EagerGraph) on every rank; bad settings refused before
any process starts; and the server at N = 2 answering like the offline engine.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import openai
import pytest
import torch
import torch.distributed as dist
from test_engine_config import on_cuda
from tiny_models import make_seq, random_prompts
from torch import nn

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams, load_model, load_tokenizer
from minivllm.executor import step_messages as messages
from minivllm.executor.tensor_parallel import TensorParallelRunner
from minivllm.distributed.layers import column_parallel, row_parallel, vocab_parallel_lookup, vocab_rows, vocab_shard
from minivllm.distributed.shard import kv_split
from minivllm.distributed.simulate import sharded_logits
from minivllm.worker.cuda_graphs import EagerGraph
from minivllm.worker.model_runner import StepPlan
from minivllm.worker.prepare import build_step_arrays
from minivllm.core.trace import Trace
from minivllm.entrypoints.openai import threaded

pytestmark = [pytest.mark.ch14, pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)
STARVED = dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=12, max_num_seqs=4, enable_prefix_caching=True)
EXIT_SECONDS = 30  # a stopped worker is gone within this


def gone(pids: list[int], seconds: float = EXIT_SECONDS) -> bool:
    """Whether every process in pids has exited (a zombie counts as exited) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(running(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@contextmanager
def tensor_parallel(make, *args, **kwargs) -> Iterator:
    """make(*args, **kwargs) (an LLM or LLMEngine with tensor_parallel_size > 1), shut down on
    leaving, whatever happened: a process holds one torch.distributed group at a time."""
    assert not dist.is_initialized(), "an earlier test left a tensor-parallel engine running"
    engine = make(*args, **kwargs)
    runner = (engine.engine if isinstance(engine, LLM) else engine).core.runner
    try:
        yield engine
    finally:
        pids = runner.pids
        runner.shutdown()
        assert gone(pids), f"workers {pids} still running after shutdown"
        assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------
# The exercises, without processes: N ranks simulated by adding up the shards' partial results
# ------------------------------------------------------------------------------------------


def linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        if bias:
            layer.bias.mul_(100)  # a bias added N times instead of once cannot hide
    return layer.requires_grad_(False)


@pytest.mark.parametrize("world_size", [1, 2, 3, 6])
@pytest.mark.parametrize("bias", [False, True])
def test_column_parallel_shards_side_by_side_are_the_layer(world_size, bias):
    full = linear(5, 12, bias)
    x = torch.randn(7, 5, dtype=torch.float64)
    shards = [column_parallel(full, r, world_size) for r in range(world_size)]
    for r, shard in enumerate(shards):
        assert isinstance(shard, nn.Linear) and shard.weight.shape == (12 // world_size, 5), f"rank {r}"
        assert shard.weight.dtype == full.weight.dtype and (shard.bias is not None) == bias, f"rank {r}"
        assert shard.weight.untyped_storage().data_ptr() != full.weight.untyped_storage().data_ptr(), \
            f"rank {r}: the shard's weight must be a new tensor, not a view of the full layer's"
    torch.testing.assert_close(torch.cat([s(x) for s in shards], dim=-1), full(x), rtol=0, atol=1e-12,
                               msg=f"the {world_size} shards' outputs, side by side, differ from the layer's")
    before = full.weight.clone()
    with torch.no_grad():
        shards[0].weight.add_(1)
    assert torch.equal(full.weight, before), "changing a shard changed the full layer"


@pytest.mark.parametrize("world_size", [1, 2, 3, 6])
@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_partial_sums_add_up_to_the_layer(world_size, bias):
    full = linear(12, 5, bias, seed=1)
    x = torch.randn(7, 12, dtype=torch.float64)
    k = 12 // world_size
    shards = [row_parallel(full, r, world_size) for r in range(world_size)]
    for r, shard in enumerate(shards):
        assert isinstance(shard, nn.Linear) and shard.weight.shape == (5, k), f"rank {r}"
        assert (shard.bias is not None) == (bias and r == 0), \
            f"rank {r}: only rank 0 keeps the bias (the all-reduce would add it {world_size} times)"
        assert shard.weight.untyped_storage().data_ptr() != full.weight.untyped_storage().data_ptr()
    partials = [s(x[:, r * k:(r + 1) * k]) for r, s in enumerate(shards)]  # what each rank computes
    torch.testing.assert_close(sum(partials), full(x), rtol=0, atol=1e-9,
                               msg=f"the {world_size} partial sums (the all-reduce) differ from the layer's output")


@pytest.mark.parametrize("split", [column_parallel, row_parallel])
def test_a_split_that_cannot_be_even_is_refused(split):
    full = linear(6, 6, True)
    for bad in [dict(rank=0, world_size=4), dict(rank=2, world_size=2), dict(rank=-1, world_size=2),
                dict(rank=0, world_size=0), dict(rank=True, world_size=2), dict(rank=0, world_size=2.0)]:
        with pytest.raises(ValueError):
            split(full, **bad)


def test_mlp_shards_with_their_all_reduce_are_the_mlp():
    """gate/up by columns, SiLU·mul per feature, down by rows, then the sum: Megatron's MLP."""
    gate, up, down = linear(8, 12, False, 2), linear(8, 12, False, 3), linear(12, 8, True, 4)
    x = torch.randn(5, 8, dtype=torch.float64)
    expected = down(torch.nn.functional.silu(gate(x)) * up(x))
    for n in (1, 2, 4):
        partials = [row_parallel(down, r, n)(torch.nn.functional.silu(column_parallel(gate, r, n)(x))
                                             * column_parallel(up, r, n)(x)) for r in range(n)]
        torch.testing.assert_close(sum(partials), expected, rtol=0, atol=1e-9, msg=f"{n} ranks")


@pytest.mark.parametrize("vocab, world_size", [(10, 1), (10, 2), (10, 3), (10, 4), (7, 4), (97, 4)])
def test_vocab_parallel_lookups_add_up_to_the_embedding(vocab, world_size):
    torch.manual_seed(5)
    table = torch.randn(vocab, 6, dtype=torch.float64)
    ids = torch.tensor([0, vocab - 1, 3 % vocab, 1, vocab // 2, 0, vocab - 1])
    rows = vocab_rows(vocab, world_size)
    partials = []
    for r in range(world_size):
        shard = vocab_shard(table, r, world_size)
        assert shard.shape == (rows, 6) and not shard[max(0, vocab - r * rows):].any(), "padding rows are zeros"
        out = vocab_parallel_lookup(ids, shard, r * rows)
        assert out.shape == (len(ids), 6) and out.dtype == table.dtype, f"rank {r}"
        mine = (ids >= r * rows) & (ids < (r + 1) * rows)
        assert not out[~mine].any(), f"rank {r} returned non-zero rows for tokens another rank holds"
        partials.append(out)
    torch.testing.assert_close(sum(partials), table[ids], rtol=0, atol=0,
                               msg="the ranks' lookups, added up, are not the full embedding")


def test_vocab_parallel_lookup_never_reads_outside_its_rows():
    shard = torch.arange(12, dtype=torch.float32).view(3, 4) + 1  # rows for tokens 3, 4, 5
    ids = torch.tensor([0, 2, 3, 5, 6, 1000])
    out = vocab_parallel_lookup(ids, shard, start=3)
    expected = torch.zeros(6, 4)
    expected[2], expected[3] = shard[0], shard[2]
    assert torch.equal(out, expected), f"lookup of {ids.tolist()} in rows 3..5:\n{out}"
    assert out.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr(), "a new tensor, not a view"


# ------------------------------------------------------------------------------------------
# A whole model's shards, N threads in lockstep, against transformers
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_shards_of_the_model_compute_its_logits(hf_models, family, world_size):
    hf = hf_models[family]
    model = load_model(hf, device="cpu")
    ids = torch.tensor(random_prompts([11], seed=3)[0])
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = sharded_logits(model, world_size, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4,
                               msg=f"{family}, {world_size} ranks: the shards' logits differ from transformers'")


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(hf_models, family, world_size):
    """Query head h reads KV head h // (H / Hkv): a rank's KV heads are those of its query heads,
    the same on the ranks that share one when N exceeds the KV heads."""
    from minivllm.distributed.layers import Communicator
    from minivllm.distributed.shard import shard_decoder

    model = load_model(hf_models[family], device="cpu")
    cfg = model.config
    q_per_rank, group = cfg.num_heads // world_size, cfg.num_heads // cfg.num_kv_heads
    full = model.layers[0].self_attn.k_proj.weight.view(cfg.num_kv_heads, cfg.head_dim, -1)
    for rank in range(world_size):
        kv_heads = sorted({h // group for h in range(rank * q_per_rank, (rank + 1) * q_per_rank)})
        shard = shard_decoder(model, Communicator(rank, world_size)).layers[0].self_attn
        assert shard.num_heads == q_per_rank and shard.num_kv_heads == len(kv_heads), f"rank {rank}"
        assert torch.equal(shard.k_proj.weight, full[kv_heads].reshape(-1, full.shape[-1])), \
            f"{family}, rank {rank} of {world_size}: k_proj does not hold KV heads {kv_heads}"
        assert kv_split(cfg, rank, world_size)[1] in (world_size, cfg.num_kv_heads)


# ------------------------------------------------------------------------------------------
# The step message
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_a_step_plan_survives_its_message(seed):
    rng = random.Random(seed)
    seqs, num_new = [], []
    for i in range(rng.randint(1, 5)):
        total = rng.randint(2, 30)
        computed = rng.randint(0, total - 1)
        seqs.append(make_seq(str(i), [rng.randrange(97) for _ in range(total)], computed,
                             rng.sample(range(100), -(-total // 4))))
        num_new.append(rng.randint(1, total - computed))
    graph = seed == 2  # a padded decode step, as a CUDA graph replays it
    arrays = build_step_arrays(seqs, [1] * len(seqs) if graph else num_new, 4,
                               num_rows=8 if graph else None, pad_block=99 if graph else None)
    pieces = 32 if seed == 1 else None  # a step replayed from the pieces of a 32-token bucket (chapter 9)
    plan = StepPlan(arrays, len(seqs), 8 if graph else None, pieces, {0: (0, 3), len(seqs) - 1: (5, 9)})
    header, body = messages.encode(plan)
    assert messages.body_size(header) == len(body)
    got = messages.decode(header, body)
    assert ((got.num_seqs, got.graph_size, got.piece_size, got.prompt_rows)
            == (plan.num_seqs, plan.graph_size, plan.piece_size, plan.prompt_rows))
    for field in dataclasses.fields(arrays):
        a, b = getattr(arrays, field.name), getattr(got.arrays, field.name)
        assert np.array_equal(np.asarray(a), np.asarray(b)), field.name
    assert messages.decode(*messages.encode(None)) is None  # STOP


# ------------------------------------------------------------------------------------------
# The engine on N processes
# ------------------------------------------------------------------------------------------

# A shared system prompt of 9 tokens (two full 4-token blocks) under most prompts: prefix caching finds them.
SYSTEM = random_prompts([9], seed=7)[0]
PROMPTS = [SYSTEM + random_prompts([6], seed=1)[0], random_prompts([13], seed=2)[0], SYSTEM + random_prompts([3], seed=3)[0],
           SYSTEM[:8], SYSTEM + random_prompts([11], seed=4)[0], random_prompts([5], seed=5)[0]]
LENGTHS = [9, 12, 6, 10, 7, 11]


@pytest.mark.parametrize("world_size", [2, 4])
def test_greedy_matches_transformers_under_starvation(hf_models, family, world_size, reference):
    hf = hf_models[family]
    model = load_model(hf, device="cpu")
    with tensor_parallel(LLM, model, tensor_parallel_size=world_size, **STARVED) as llm:
        assert len(llm.engine.core.runner.pids) == world_size - 1
        llm.trace = Trace()
        outs = llm.generate(PROMPTS, [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS], use_tqdm=False)
        for i, (prompt, n, out) in enumerate(zip(PROMPTS, LENGTHS, outs)):
            assert out.outputs[0].token_ids == reference(hf, prompt, n), f"{family}, N={world_size}, prompt {i}"
        steps = llm.trace.steps
        assert sum(len(s.preempted) for s in steps) > 0, "the pool was meant to force preemption"
        assert llm.trace.num_cached_tokens > 0, "prefix caching was meant to find the shared blocks"
        prefills = [r for s in steps for r in s.prefill]
        assert any(prefills.count(r) > 1 for r in prefills), "some prompt was meant to be prefilled in chunks"
        # Logprobs, prompt logprobs included (the prompt rows travel in the message), as on one process.
        params = SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2, **GREEDY)
        many = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    one = LLM(model, **STARVED).generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(one, many):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pos_a, pos_b in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:],
                                b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert list(pos_a) == list(pos_b), "the same top tokens, in the same order"
            np.testing.assert_allclose([lp.logprob for lp in pos_a.values()], [lp.logprob for lp in pos_b.values()],
                                       rtol=0, atol=1e-4)


def test_every_rank_replays_graphs(qwen3_model, hf_models, reference):
    """The graph runner's path on every rank (EagerGraph stands in for CUDA graphs on a CPU):
    rank 0 prepares the padded step, the others load it into their own static buffers."""
    config = EngineConfig(block_size=4, num_kv_blocks=40, max_num_seqs=5, enable_prefix_caching=False)
    engine = LLMEngine(qwen3_model, config=config)
    resolved = dataclasses.replace(engine.config, cuda_graphs=True, tensor_parallel_size=2)
    assert not dist.is_initialized()
    engine.core.runner = TensorParallelRunner(qwen3_model, resolved, graph_class=EagerGraph)
    try:
        replays = []
        replay = engine.core.runner.graphs.replay
        engine.core.runner.graphs.replay = lambda size, n: replays.append((size, n)) or replay(size, n)
        for i, prompt in enumerate(PROMPTS[:5]):
            engine.add_request(prompt=prompt, params=SamplingParams(max_tokens=LENGTHS[i], **GREEDY), request_id=str(i))
        outs = {}
        while engine.has_unfinished_requests():
            outs |= {o.request_id: o for o in engine.step() if o.finished}
        assert any(size > n for size, n in replays), f"some decode step should replay a padded bucket: {replays}"
        for i, prompt in enumerate(PROMPTS[:5]):
            assert outs[str(i)].outputs[0].token_ids == reference(hf_models["qwen3"], prompt, LENGTHS[i]), i
    finally:
        engine.core.runner.shutdown()


@pytest.mark.parametrize("size, match", [
    (0, "tensor_parallel_size must be an integer >= 1"), (-2, "an integer >= 1"), (1.0, "an integer >= 1"),
    (True, "an integer >= 1"), ("2", "an integer >= 1"),
    (3, "must divide the model's 4 attention heads"),
])
def test_bad_sizes_are_refused_before_any_process_starts(qwen3_model, size, match):
    with pytest.raises(ValueError, match=match):
        LLM(qwen3_model, tensor_parallel_size=size)
    assert multiprocessing.active_children() == [] and not dist.is_initialized()


def test_shapes_that_cannot_split_and_missing_gpus_are_refused(qwen3_model):
    cfg = qwen3_model.config
    for change, match in [(dict(num_heads=6, num_kv_heads=3), "3 KV heads"),
                          (dict(intermediate_size=95), "intermediate_size=95")]:
        odd = SimpleNamespace(config=dataclasses.replace(cfg, **change), device=torch.device("cpu"), dtype=torch.float32)
        with pytest.raises(ValueError, match=match):
            EngineConfig(tensor_parallel_size=2, num_kv_blocks=8).resolve(odd)
    gpus = torch.cuda.device_count()
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        EngineConfig(tensor_parallel_size=gpus + 2, num_kv_blocks=64).resolve(on_cuda(qwen3_model))


# ------------------------------------------------------------------------------------------
# The server at N = 2
# ------------------------------------------------------------------------------------------


def test_the_server_on_two_processes_answers_like_the_offline_engine():
    """`minivllm serve --tensor-parallel-size 2`'s engine, served, against LLM.generate on one process."""
    from minivllm.entrypoints.cli import build_parser, engine_options

    prompts = ["import os\n\ndef list_files(path):\n    return", "class Stack:\n    def push(self, item):\n        self.",
               "for i in range("]
    expected = [o.outputs[0].text for o in LLM(load_model(device="cpu"), tokenizer=load_tokenizer()).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)]
    options = engine_options(build_parser().parse_args(["serve", "--device", "cpu", "--tensor-parallel-size", "2"]))
    assert options["tensor_parallel_size"] == 2
    with tensor_parallel(LLMEngine, None, **options) as engine:
        with threaded.running_server(engine, "tp") as (url, _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
            for prompt, text in zip(prompts, expected):
                answer = client.completions.create(model="tp", prompt=prompt, max_tokens=16, temperature=0.0)
                assert answer.choices[0].text == text
                streamed = "".join(c.choices[0].text for c in client.completions.create(
                    model="tp", prompt=prompt, max_tokens=16, temperature=0.0, stream=True) if c.choices)
                assert streamed == text
