"""Chapter 16: the persistent batch. Its step arrays equal chapter 9's build_step_arrays (built
from the requests' lists) at every step of engines that chunk, preempt, share prefixes and roll
speculation back; a running request keeps its row and a step writes only the blocks it gained."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from tiny_models import make_seq, random_prompts

import minivllm
from minivllm import LLMEngine, SamplingParams
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.prepare import build_step_arrays
from minivllm.request.sequence import Status

pytestmark = [pytest.mark.ch16, pytest.mark.timeout(240), pytest.mark.floors]

FIELDS = ("input_ids", "positions", "slot_mapping", "query_start", "context_lens", "block_tables", "sample_rows")
GREEDY = dict(temperature=0.0, ignore_eos=True)
STARVED = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=24)
PROMPTS = random_prompts([5, 17, 9, 30, 12, 23])
LENGTHS = [12, 8, 15, 10, 14, 9]


def assert_same(a, b) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and (x == y).all(), f"{name}: {x} != {y}"
    assert a.samplers == b.samplers


def checked(batch: InputBatch, steps: list[int]):
    """batch.step_arrays, compared with build_step_arrays from the same sequences every call."""
    step_arrays = batch.step_arrays

    def check(seqs, num_new, num_rows=None, pad_block=None, query_len=None):
        arrays = step_arrays(seqs, num_new, num_rows, pad_block, query_len)
        assert_same(arrays, build_step_arrays(seqs, num_new, batch.block_size, num_rows, pad_block=pad_block,
                                              query_len=query_len))
        steps.append(len(seqs))
        return arrays

    return check


def draft_of(hf_model) -> minivllm.Decoder:
    settings = {k: v for k, v in hf_model.config.to_dict().items() if k != "layer_types"}
    config = hf_model.config.__class__(**{**settings, "num_hidden_layers": 1})
    torch.manual_seed(123)
    return minivllm.load_model(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(),
                               device="cpu")


@pytest.mark.parametrize("case", ["starved", "prefix-cache", "draft-model", "graphs"])
def test_step_arrays_equal_chapter_9s_at_every_step(qwen3_model, hf_models, reference, case):
    settings = dict(STARVED, enable_prefix_caching=case == "prefix-cache")
    if case == "draft-model":  # rollbacks shrink and regrow tables, in the target's runner and the draft's
        settings["speculative_config"] = {"model": draft_of(hf_models["qwen3"]), "num_speculative_tokens": 3}
    if case == "graphs":  # the decode steps padded to a bucket (EagerGraph stands in for CUDA graphs on a CPU)
        settings = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8)
    engine = LLMEngine(qwen3_model, **settings)
    if case == "graphs":  # as chapter 9's checks do: a runner with graphs, on a CPU
        engine.core.runner = ModelRunner(engine.model, dataclasses.replace(engine.config, cuda_graphs=True))
    steps: list[int] = []
    runners = [engine.core.runner] + ([engine.core.speculator.proposer.runner] if case == "draft-model" else [])
    for runner in runners:
        runner.batch.step_arrays = checked(runner.batch, steps)
    prompts = PROMPTS if case != "prefix-cache" else [PROMPTS[3][:12] + p[:12] for p in PROMPTS]
    for i, (prompt, n) in enumerate(zip(prompts, LENGTHS)):
        engine.add_request(prompt=prompt, params=SamplingParams(max_tokens=n, **GREEDY), request_id=str(i))
    done = {}
    for _ in range(500):
        done |= {out.request_id: out.outputs[0].token_ids for out in engine.step()}
        if not engine.has_unfinished_requests():
            break
    assert len(steps) >= max(LENGTHS)
    assert done == {str(i): reference(hf_models["qwen3"], p, n) for i, (p, n) in enumerate(zip(prompts, LENGTHS))}


def test_a_running_request_keeps_its_row_and_writes_only_new_blocks():
    batch = InputBatch(max_num_seqs=4, width=8, block_size=4, device=torch.device("cpu"))
    a, b = make_seq("a", list(range(7)), 6, [3, 5]), make_seq("b", list(range(2)), 1, [9])
    for seq in (a, b):
        seq.status = Status.RUNNING
    batch.step_arrays([a, b], [1, 1])
    rows = dict(batch.row_of)
    writes = []
    tables = batch.tables
    batch.tables = Spy(tables, writes)
    a.token_ids += [1, 2]
    a.num_computed_tokens, a.block_table = 8, a.block_table + [7]  # a starts a block
    b.token_ids.append(1)
    b.num_computed_tokens = 2
    arrays = batch.step_arrays([b, a], [1, 1])  # another order: rows follow the requests, not the order
    assert batch.row_of == rows
    assert writes == [(rows[a], slice(2, 3, None), [7])], "only a's new block is written"
    assert arrays.block_tables.tolist() == [[9, -1, -1], [3, 5, 7]]
    # a finishes; a newcomer gets its row once the free rows run out, cleared first.
    batch.tables = tables
    a.status = Status.FINISHED
    others = [make_seq(str(i), [1, 2], 1, [20 + i]) for i in range(3)]
    for seq in others:
        seq.status = Status.RUNNING
    arrays = batch.step_arrays([b] + others, [1] * 4)
    assert a not in batch.row_of and len(batch) == 4
    assert arrays.block_tables.tolist() == [[9], [20], [21], [22]]
    assert (batch.tables[batch.row_of[others[-1]], 1:] == -1).all()


def test_a_preempted_request_is_rewritten():
    batch = InputBatch(max_num_seqs=2, width=8, block_size=4, device=torch.device("cpu"))
    a = make_seq("a", list(range(9)), 8, [3, 5, 6])
    a.status = Status.RUNNING
    batch.step_arrays([a], [1])
    a.block_table, a.num_computed_tokens, a.num_preemptions = [8, 2, 4], 8, 1  # recomputed into other blocks
    assert batch.step_arrays([a], [1]).block_tables.tolist() == [[8, 2, 4]]


def test_update_rewrites_the_row_of_a_request_preempted_since_and_then_only_its_differences():
    """Exercise 16.1, focused, on update itself: a request preempted since its row was written
    (version[row] != seq.num_preemptions) has its row cleared and written whole, even when its new
    table is as long as the old one, and version[row] becomes the new count; the next step, whose
    table did not change, writes nothing."""
    batch = InputBatch(max_num_seqs=2, width=8, block_size=4, device=torch.device("cpu"))
    a = make_seq("a", list(range(9)), 8, [3, 5, 6])
    a.status = Status.RUNNING
    (row,) = batch.update([a])
    a.block_table, a.num_preemptions = [8, 2, 4], 1  # recomputed into other blocks, as many as before
    assert batch.update([a]).tolist() == [row], "a running request keeps its row"
    held = batch.tables[row].tolist()
    assert held[:4] == [8, 2, 4, -1], (
        f"a request preempted since its row was written (version 0 != num_preemptions 1) must have its row "
        f"cleared and written whole from its new table [8, 2, 4], even though it is as long as the old one "
        f"[3, 5, 6]: the row holds {held[:4]}")
    assert int(batch.num_blocks[row]) == 3 and int(batch.version[row]) == 1, (
        f"after the rewrite num_blocks[row] must be the table's length (3) and version[row] the preemption count "
        f"(1): got {int(batch.num_blocks[row])} and {int(batch.version[row])}")
    a.block_table = [8, 2, 4, 1]  # it grows again by one block: only that block is written
    writes, tables = [], batch.tables
    batch.tables = Spy(tables, writes)
    batch.update([a])
    assert writes == [(row, slice(3, 4, None), [1])], f"only the block it gained is written, got {writes}"
    writes.clear()
    batch.update([a])
    assert writes == [], f"an unchanged table writes nothing, got {writes}"


class Spy:
    """Records the writes into an array (row, columns, values), reads pass through."""

    def __init__(self, array: np.ndarray, writes: list):
        self.array, self.writes = array, writes

    def __getitem__(self, key):
        return self.array[key]

    def __setitem__(self, key, value):
        row, cols = key
        self.writes.append((int(row), cols, list(np.atleast_1d(value))))
        self.array[key] = value

    def __getattr__(self, name):
        return getattr(self.array, name)
