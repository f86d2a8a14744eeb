"""Chapter 14's script on the tiny checkpoint, end to end: it writes its figures and JSON, every
tensor-parallel size gives the same tokens, the sharded-layer picture comes from shards that tile
each matrix, and the communication it measured is exactly what the layer structure predicts —
per forward pass 2 all-reduces per layer and 1 for the embedding, of [tokens, hidden], and one
gather of the sampled rows' logits. And the cost model's arithmetic, against hand computations."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import run_script

from minivllm.course.bench.tp_cost import (GPU, LINKS, Link, Shape, allreduce_bytes_per_token_per_layer, copies_or_splits,
                                    copies_step, decode_step, model_shapes, ring_allreduce_seconds, speedup_grid)
from minivllm.loader import CONFIGS, read_config

pytestmark = [pytest.mark.ch14, pytest.mark.floors]

SCRIPT = Path(__file__).parents[1] / "chapters" / "14_tensor_parallelism.py"
SIZES, REQUESTS, PROMPT, OUTPUT = (1, 2, 4), 3, 6, 5


@pytest.fixture(scope="module")
def payload(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ch14")
    args = ["--model", str(tiny_checkpoint), "--device", "cpu", "--sizes", ",".join(map(str, SIZES)),
            "--requests", str(REQUESTS), "--prompt", str(PROMPT), "--output", str(OUTPUT), "--sample-tokens", "4"]
    return run_script(SCRIPT, args, folder, "14_tensor_parallelism_cpu",  # one run for all the checks below
                      figures=("14_sharded_layer", "14_step_split", "14_tp_cost",
                               "14_copies_or_splits_cost"))


def test_every_size_gives_the_same_tokens(payload):
    assert payload["sample"]["same_tokens"]
    split = payload["step_split"]
    assert [row["size"] for row in split["sizes"]] == list(SIZES) and split["same_tokens"]


def test_measured_communication_is_what_the_layers_call(payload):
    model = payload["environment"]["model"]
    layers, hidden, vocab = model["num_layers"], model["hidden_size"], model["vocab_size"]
    for row in payload["step_split"]["sizes"]:
        n = row["size"]
        assert row["tokens_computed"] == REQUESTS * (PROMPT + OUTPUT - 1), "no preemption, nothing cached"
        if n == 1:
            assert row["comm_bytes_total"] == 0 and row["comm_calls"] == 0
            continue
        activations = (2 * layers + 1) * row["tokens_computed"] * hidden * 4  # fp32 all-reduces of [T, hidden]
        logits = REQUESTS * OUTPUT * math.ceil(vocab / n) * 4  # each sampled row's share, gathered on rank 0
        assert row["comm_bytes_total"] == activations + logits, f"N={n}"
        assert row["comm_calls"] == 2 * layers + 2, f"N={n}: collectives per step"
        assert 0 <= row["comm_seconds"] <= row["step_seconds"]


def test_the_layer_picture_comes_from_shards_that_tile_each_matrix(payload):
    layout = payload["sharded_layer"]["layout"]
    assert [m["name"] for m in layout] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for m in layout:
        size = m["out_features"] if m["kind"] == "column" else m["in_features"]
        spans = sorted(map(tuple, m["ranks"]))
        assert spans[0][0] == 0 and spans[-1][1] == size, m["name"]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"{m['name']}: {spans} do not tile [0, {size})"
        assert m["kind"] == ("row" if m["name"] in ("o_proj", "down_proj") else "column")


def test_the_cost_model_prices_what_it_says():
    llama7 = read_config(CONFIGS / "llama-2-7b.json")
    assert allreduce_bytes_per_token_per_layer(llama7.hidden_size) == 16 * 1024  # 2 x 4,096 x 2 bytes
    shape = Shape.of("7b", llama7)
    assert shape.kv_bytes_per_token == llama7.kv_bytes_per_token(torch.bfloat16) == 512 * 1024
    link = Link("test", 4, 100e9, 10e-6, "")
    assert ring_allreduce_seconds(1e6, 1, link) == 0
    assert ring_allreduce_seconds(1e6, 4, link) == pytest.approx(10e-6 + 2 * 1e6 * 3 / 4 / 100e9)
    one = decode_step(shape, 1, 1, link)
    assert one["comm"] == 0
    assert one["compute"] == pytest.approx((shape.parameters * 2 + 1024 * shape.kv_bytes_per_token) / 3.35e12)
    four = decode_step(shape, 1, 4, link)
    layers = llama7.num_layers
    expected = (2 * layers + 1) * (10e-6 + 2 * 4096 * 2 * 3 / 4 / 100e9) + 10e-6 + 32000 * 2 * 3 / 4 / 100e9
    assert four["comm"] == pytest.approx(expected)
    # A free link (no latency, infinite bandwidth): a memory-bound step gets N times faster...
    free = Link("free", 4, math.inf, 0.0, "")
    assert speedup_grid([shape], [1], free)["speedup"][0, 0] == pytest.approx(4)
    # ...unless its KV heads cannot split: one KV head is replicated on every rank.
    mqa = Shape("mqa", shape.parameters, shape.hidden, shape.layers, shape.vocab, 1, shape.kv_bytes_per_token)
    kv_read = 1024 * shape.kv_bytes_per_token
    assert decode_step(mqa, 1, 4, free)["memory"] == pytest.approx(shape.parameters * 2 / 4 + kv_read)


def test_the_cost_model_covers_the_models_and_links_it_names():
    shapes = model_shapes()
    assert [s.name for s in shapes][:3] == ["Qwen3-0.6B", "Llama-3.2-1B", "Llama-2-7B"]
    assert 0.5e9 < shapes[0].parameters < 0.7e9 and 400e9 < shapes[-1].parameters < 410e9
    assert [link.ranks for link in LINKS] == [8, 8, 16, 16] and all(link.source for link in LINKS)
    grid = speedup_grid(shapes, [1, 1024], LINKS[0])
    assert not grid["fits_one"][-1].any() and math.isnan(grid["speedup"][-1, 0]), "405B in bf16 fits no 8 GPUs"


def test_one_copy_is_one_gpu_is_a_split_in_one():
    """At N = 1 copies, one GPU and a one-way split are the same step, fitting or not."""
    shapes, batches = model_shapes(), [1, 3, 64, 1024]
    grid = copies_or_splits(shapes, batches, Link("one", 1, 100e9, 10e-6, ""))
    for key in ("tokens_per_second", "step_seconds"):
        one = grid["one GPU"][key]
        assert np.isnan(one).any() and not np.isnan(one).all(), "some cells fit, some do not"
        np.testing.assert_array_equal(grid["copies"][key], one)
        np.testing.assert_array_equal(grid["split"][key], one)


@pytest.mark.parametrize("copies", [2, 8])
def test_n_copies_serve_n_times_one_gpu_at_a_nth_of_the_batch(copies):
    shape, link = model_shapes()[0], Link("test", copies, 100e9, 10e-6, "")  # link.ranks copies
    for per_copy in (1, 16, 100):
        batch = copies * per_copy
        alone = decode_step(shape, per_copy, 1, link)
        grid = copies_or_splits([shape], [batch, per_copy], link)
        assert grid["copies"]["tokens_per_second"][0, 0] == pytest.approx(copies * per_copy / alone["seconds"])
        assert grid["copies"]["tokens_per_second"][0, 0] == pytest.approx(
            copies * grid["one GPU"]["tokens_per_second"][0, 1])
        assert grid["copies"]["step_seconds"][0, 0] == pytest.approx(alone["seconds"]), "a copy keeps one GPU's step"
    # An uneven batch waits for the busiest copy: 9 sequences on 8 copies take a 2-sequence step.
    assert copies_step(shape, copies + 1, copies)["seconds"] == decode_step(shape, 2, 1, link)["seconds"]


def test_a_copy_holds_all_the_weights_a_split_only_its_share():
    llama7 = Shape.of("7b", read_config(CONFIGS / "llama-2-7b.json"))
    step = copies_step(llama7, 64, 8)
    assert step["memory"] == pytest.approx(llama7.parameters * 2 + 8 * 1024 * llama7.kv_bytes_per_token)
    # Weights of 100 GB in bf16: no GPU of 80 GB holds a copy, 8 GPUs hold 12.5 GB each of a split.
    big = Shape("big", 50_000_000_000, llama7.hidden, llama7.layers, llama7.vocab, llama7.kv_heads,
                llama7.kv_bytes_per_token)
    assert big.parameters * 2 > GPU.memory > big.parameters * 2 / 8
    grid = copies_or_splits([big], [1, 8], LINKS[0])
    for way in ("one GPU", "copies"):
        assert np.isnan(grid[way]["tokens_per_second"]).all() and np.isnan(grid[way]["step_seconds"]).all(), way
    assert np.isfinite(grid["split"]["tokens_per_second"]).all() and (grid["split"]["tokens_per_second"] > 0).all()


def test_copies_never_communicate():
    """The link prices the split's all-reduces; the copies' cost does not change with it."""
    shapes, batches = model_shapes()[:4], [1, 16, 256]
    fast = copies_or_splits(shapes, batches, Link("fast", 8, 900e9, 1e-6, ""))
    slow = copies_or_splits(shapes, batches, Link("slow", 8, 1e9, 1e-3, ""))
    for way in ("one GPU", "copies"):
        np.testing.assert_array_equal(fast[way]["tokens_per_second"], slow[way]["tokens_per_second"])
    assert (fast["split"]["step_seconds"] < slow["split"]["step_seconds"]).all()
    assert all(copies_step(s, b, 8)["comm"] == 0 for s in shapes for b in batches)
