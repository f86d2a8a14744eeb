"""Chapter 9: the lean step and CUDA graphs, on the CPU.

There are no CUDA graphs on a CPU, so the graph runner runs with `EagerGraph`, which stands in
for a captured graph (same static buffers, batch-size buckets and padding rows; replay just
calls the forward again). That checks what can go wrong in the runner itself: a wrong bucket,
padding rows that write into a request's cache, stale rows in the static buffers, a wrong row
read back. The graph class follows the model's device, so these CPU models use `EagerGraph`
on a GPU machine too; the checks marked `gpu` load the model on CUDA and capture for real.
"""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import make_seq, random_prompts, run_script

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.worker.cuda_graphs import CudaGraph, EagerGraph, GraphRunner, bucket_for, graph_batch_sizes
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.prepare import build_step_arrays

pytestmark = [pytest.mark.ch09, pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)
ON_GPU = torch.cuda.is_available()


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]


@pytest.mark.parametrize("sizes", [[1, 2, 4, 8, 16, 32, 40], [3], [1, 7, 8, 100]])
def test_bucket_for_is_the_smallest_size_that_fits(sizes):
    for n in range(1, sizes[-1] + 1):
        expected = min(s for s in sizes if s >= n)
        assert bucket_for(n, sizes) == expected, f"bucket_for({n}, {sizes})"
    for bad in (0, -1, sizes[-1] + 1):
        with pytest.raises(ValueError):
            bucket_for(bad, sizes)


@pytest.mark.parametrize("seed", range(4))
def test_step_arrays_against_a_token_by_token_reference(seed):
    """build_step_arrays (vectorised) against the definitions, written token by token."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 16])
    free = list(range(200))
    rng.shuffle(free)
    seqs, num_new = [], []
    for i in range(rng.randint(1, 6)):
        total = rng.randint(1, 40)
        computed = rng.randint(0, total - 1)
        n = rng.randint(1, total - computed)
        table = [free.pop() for _ in range(-(-(computed + n) // block_size))]
        seqs.append(make_seq(str(i), [rng.randrange(97) for _ in range(total)], computed, table))
        num_new.append(n)
    a = build_step_arrays(seqs, num_new, block_size)
    ids, positions, slots, samplers, rows = [], [], [], [], []
    for i, (seq, n) in enumerate(zip(seqs, num_new)):
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // block_size] * block_size + p % block_size)
        if seq.num_computed_tokens + n == seq.num_tokens:
            samplers.append(i)
            rows.append(len(ids) - 1)
    assert a.input_ids.tolist() == ids and a.positions.tolist() == positions and a.slot_mapping.tolist() == slots
    assert a.samplers == samplers and a.sample_rows.tolist() == rows
    assert a.query_start.tolist() == [0, *np.cumsum(num_new).tolist()]
    assert a.context_lens.tolist() == [s.num_computed_tokens + n for s, n in zip(seqs, num_new)]
    for seq, row in zip(seqs, a.block_tables.tolist()):
        assert row[:len(seq.block_table)] == seq.block_table and set(row[len(seq.block_table):]) <= {-1}


def test_padding_rows_only_touch_the_spare_block():
    seqs = [make_seq("a", [5, 6, 7], 2, [4]), make_seq("b", [1, 2], 1, [9])]
    a = build_step_arrays(seqs, [1, 1], block_size=4, num_rows=5, width=3, pad_block=11)
    assert a.input_ids.tolist() == [7, 2, 0, 0, 0] and a.positions.tolist() == [2, 1, 0, 0, 0]
    assert a.slot_mapping.tolist() == [4 * 4 + 2, 9 * 4 + 1, 44, 44, 44]
    assert a.block_tables.tolist() == [[4, -1, -1], [9, -1, -1], [11, -1, -1], [11, -1, -1], [11, -1, -1]]
    assert a.context_lens.tolist() == [3, 2, 1, 1, 1] and a.samplers == [0, 1]
    with pytest.raises(ValueError):
        build_step_arrays(seqs, [1, 1], block_size=4, num_rows=1)  # fewer rows than sequences
    with pytest.raises(ValueError):
        build_step_arrays(seqs, [1, 1], block_size=4, num_rows=3)  # padding without a spare block


def with_graphs(llm: LLM, **options) -> LLM:
    """Swap the engine's runner for one that replays decode steps from graphs: captured ones on
    CUDA, the stand-in on a CPU (the runner chooses by the model's device)."""
    engine = llm.engine
    runner = engine.core.runner
    config = dataclasses.replace(engine.config, cuda_graphs=True, **options)
    engine.core.runner = ModelRunner(engine.model, config)
    assert runner.pool.k.shape == engine.core.runner.pool.k.shape
    expected = CudaGraph if engine.model.device.type == "cuda" else EagerGraph
    assert {type(g) for g in engine.core.runner.graphs.graphs.values()} == {expected}
    return llm


def test_the_graph_class_follows_the_pool_device(qwen3_model):
    """A CUDA graph of CPU tensors records nothing and replays nothing: CPU pools get EagerGraph,
    and CudaGraph, asked for by name, refuses them."""
    llm = with_graphs(LLM(qwen3_model, max_num_seqs=4))
    runner = llm.engine.core.runner
    with pytest.raises(ValueError, match="EagerGraph"):
        GraphRunner(runner.forward, runner.pool, runner.attention_class, 4, 64, graph_class=CudaGraph)


def test_a_replayed_step_writes_only_the_columns_it_uses(qwen3_model):
    """The graphs' tables are as wide as the longest context allowed (2,560 columns for
    Qwen3-0.6B); a step copies its tables, only as wide as its longest, in its one packed copy
    and writes them into the first columns of its rows: the rest keep what was there."""
    llm = with_graphs(LLM(qwen3_model, max_num_seqs=8, max_model_len=256, block_size=4, num_kv_blocks=64))
    graphs = llm.engine.core.runner.graphs
    assert graphs.tables.shape == (8, 64)
    seqs = [make_seq(str(i), list(range(5 + 2 * i)), 4 + 2 * i, list(range(3 * i, 3 * i + 2 + i // 2)))
            for i in range(5)]
    with torch.inference_mode():  # as the engine runs a step (the buffers were made under it)
        graphs.tables.fill_(777)  # what earlier, longer steps may have left in the tables
        size, arrays, flat = graphs.prepare(seqs)
    width = arrays.block_tables.shape[1]
    assert size == 8 and width == 4  # the longest table: 4 blocks
    assert (graphs.tables[:, width:] == 777).all(), "a step wrote columns it does not use"
    assert graphs.tables[:size, :width].tolist() == arrays.block_tables.tolist()
    assert torch.equal(flat.cpu(), torch.from_numpy(arrays.pack()))  # one copy carries the step, tables too


class CountingReplays:
    """Counts graph replays per batch size, to prove the graphs really ran."""

    def __init__(self, runner: ModelRunner):
        self.counts: dict[int, int] = {}
        for size, graph in runner.graphs.graphs.items():
            replay = graph.replay

            def counted(size=size, replay=replay):
                self.counts[size] = self.counts.get(size, 0) + 1
                replay()

            graph.replay = counted


PROMPTS = random_prompts([5, 17, 9, 30, 12, 23, 3, 14, 8])
LENGTHS = [12, 8, 15, 10, 14, 9, 20, 6, 11]


@pytest.mark.parametrize("settings", [
    dict(max_num_seqs=16),
    # starvation: tiny blocks, a pool that forces preemption, a small budget, odd bucket sizes
    dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=24, max_num_seqs=7),
], ids=["roomy", "starved"])
def test_graph_replay_gives_transformers_tokens(model, hf_model, reference, settings):
    llm = with_graphs(LLM(model, **settings))
    counter = CountingReplays(llm.engine.core.runner)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert sum(counter.counts.values()) > 0, "no decode step replayed a graph"
    assert len(counter.counts) > 2, f"only buckets {sorted(counter.counts)} were used"
    assert llm.engine.core.block_manager.num_free == llm.engine.core.block_manager.num_blocks


def test_graphs_and_eager_steps_agree_on_sampled_tokens(qwen3_model):
    """Seeded sampling reads the same logits whichever way the step ran."""
    params = [SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=i) for i, n in enumerate(LENGTHS)]
    eager = LLM(qwen3_model, max_num_seqs=8)
    graphs = with_graphs(LLM(qwen3_model, max_num_seqs=8))
    tokens = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] for llm in (eager, graphs)]
    assert tokens[0] == tokens[1]


def test_engine_switches_are_validated(qwen3_model):
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="cuda_graphs"):
            LLMEngine(qwen3_model, cuda_graphs=bad)
        with pytest.raises(ValueError, match="fused_ops"):
            LLMEngine(qwen3_model, fused_ops=bad)
    if not ON_GPU:
        with pytest.raises(ValueError, match="CUDA"):
            LLMEngine(qwen3_model, cuda_graphs=True)
    engine = LLMEngine(qwen3_model)  # on a CPU the defaults are chapter 7's engine: eager, plain PyTorch
    assert engine.core.runner.graphs is None and engine.core.runner.forward is qwen3_model


@pytest.mark.parametrize("name, value", [
    ("block_size", 0), ("block_size", 2.0), ("block_size", True), ("block_size", "16"),
    ("num_kv_blocks", 0), ("num_kv_blocks", 3.5), ("max_num_batched_tokens", 0), ("max_num_batched_tokens", 1.5),
    ("max_num_seqs", 0), ("max_num_seqs", 2.0), ("max_model_len", 0), ("max_model_len", 1), ("max_model_len", 64.0),
])
def test_bad_engine_settings_are_refused(qwen3_model, name, value):
    with pytest.raises(ValueError, match=name):
        LLMEngine(qwen3_model, **{name: value})


@pytest.mark.parametrize("settings", [
    dict(max_num_seqs=16),
    dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=24, max_num_seqs=7),
], ids=["roomy", "starved"])
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
def test_captured_graphs_give_transformers_tokens(hf_models, reference, settings):
    """Real capture: the model and its KV pool on CUDA (fp32), decode steps replayed from
    CudaGraphs of every bucket they reach, against transformers on the CPU."""
    from minivllm import load_model

    model = load_model(hf_models["qwen3"], device="cuda", dtype=torch.float32)
    llm = with_graphs(LLM(model, attention="triton", cuda_graphs=False, fused_ops=False, async_scheduling=False,
                          **settings))  # chapter 9's engine: synchronous steps
    counter = CountingReplays(llm.engine.core.runner)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [reference(hf_models["qwen3"], p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert len(counter.counts) > 2, f"only buckets {sorted(counter.counts)} were replayed"


def strict(function):
    """`function`, raising if it makes the host wait for the GPU (torch's sync debug mode)."""
    def wrapped(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return function(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapped


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device: a CPU has no host-device synchronisation to catch")
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_step_never_waits_for_the_gpu_before_reading_its_tokens(hf_models, sampled):
    """Preparing inputs and running the model (eager prefill steps and graph-replayed decode
    steps alike), and choosing the tokens (greedy, or sampled with top-p, with and without a
    seed), must not synchronise with the GPU; only reading the chosen tokens back may."""
    from minivllm import load_model

    model = load_model(hf_models["qwen3"], device="cuda")
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=128)
    assert engine.core.runner.graphs is not None
    engine.core.runner.run = strict(engine.core.runner.run)
    engine.core.sampler.sample_rows = strict(engine.core.sampler.sample_rows)  # everything but the tokens' .tolist()
    for i, prompt in enumerate(PROMPTS[:5]):
        params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=i if i % 2 else None,
                                ignore_eos=True) if sampled else SamplingParams(max_tokens=6, **GREEDY)
        engine.add_request(prompt=prompt, params=params, request_id=str(i))
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()


def test_chapter_script_runs_on_the_tiny_checkpoint(tiny_checkpoint, tmp_path):
    script = Path(__file__).resolve().parent.parent / "chapters" / "09_cuda_graphs.py"
    payload = run_script(script, ["--model", str(tiny_checkpoint), "--device", "cpu", "--batch-size", "4",
                                  "--context", "40", "--steps", "2", "--out", str(tmp_path)], tmp_path, "09_cuda_graphs_cpu")
    assert payload["same_tokens"] == {"eager": True}
    assert [p["variant"] for p in payload["profiles"]] == ["eager"]
    assert [r["batch_size"] for r in payload["lean_step"]["prepare"]] == [1, 4, 16, 64, 256]
    padding = payload["lean_step"]["padding_rows"]
    assert len(padding) == 256 and min(padding) == 0 and max(padding) == 15
    assert payload["graph_paths"]["same_tokens_as_eager"]
    assert {s["path"] for s in payload["graph_paths"]["steps"]} >= {"decode graph", "pieces"}
    for name in ("09_step_timeline", "09_step_breakdown", "09_lean_step", "09_piecewise"):
        assert (tmp_path / "figures" / f"{name}.png").stat().st_size > 10_000
