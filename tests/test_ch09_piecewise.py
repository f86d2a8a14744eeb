"""Chapter 9: steps that carry prompt tokens, replayed from graphs cut at attention.

On a CPU `EagerPieces` stands in for the captured pieces (same buckets, buffers and padding;
attention on the real rows only), so these checks prove the runner's own logic: the bucket a
step lands in, padding rows that never reach attention or the KV cache, stale rows left by a
longer step, the real rows read back. The `gpu` checks capture the pieces for real and compare
with the eager engine in fp32.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import random_prompts

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.attention.dense import attend
from minivllm.attention.masks import causal_mask
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.piecewise_graphs import AttentionSlot, EagerPieces, PiecewiseRunner, piece_token_sizes

pytestmark = [pytest.mark.ch09, pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)
ON_GPU = torch.cuda.is_available()
PROMPTS = random_prompts([5, 17, 9, 30, 12, 23, 3, 14, 8])
LENGTHS = [12, 8, 15, 10, 14, 9, 20, 6, 11]


def test_piece_token_sizes():
    assert piece_token_sizes(1) == [1]
    assert piece_token_sizes(24) == [16, 24]
    assert piece_token_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert piece_token_sizes(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert piece_token_sizes(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert piece_token_sizes(8192)[-2:] == [1792, 2048]  # larger steps run eagerly (MAX_PIECE_TOKENS)
    with pytest.raises(ValueError):
        piece_token_sizes(0)


class CountingPieces:
    """Counts replays per token bucket and the real tokens they carried, to prove the pieces ran."""

    def __init__(self, runner: ModelRunner):
        self.counts: dict[int, int] = {}
        self.padded = 0  # replays with padding rows (T < bucket)
        for size, pieces in runner.pieces.pieces.items():
            replay = pieces.replay

            def counted(num_tokens, attention, size=size, replay=replay):
                self.counts[size] = self.counts.get(size, 0) + 1
                self.padded += num_tokens < size
                return replay(num_tokens, attention)

            pieces.replay = counted


def with_pieces(llm: LLM, **options) -> LLM:
    """Swap the engine's runner for one that replays decode steps from graphs and prompt-carrying
    steps from pieces (the CPU's stand-ins here; captured on CUDA)."""
    engine = llm.engine
    config = dataclasses.replace(engine.config, cuda_graphs=True, piecewise_graphs=True, **options)
    engine.core.runner = ModelRunner(engine.model, config)
    expected = "CudaPieces" if engine.model.device.type == "cuda" else "EagerPieces"
    assert {type(p).__name__ for p in engine.core.runner.pieces.pieces.values()} == {expected}
    return llm


@pytest.mark.parametrize("settings", [
    dict(max_num_seqs=16, max_num_batched_tokens=64),
    # starvation: tiny blocks, a pool that forces preemption, a budget that chunks every prompt
    dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=24, max_num_seqs=7),
], ids=["roomy", "starved"])
def test_pieces_give_transformers_tokens(model, hf_model, reference, settings):
    llm = with_pieces(LLM(model, **settings))
    counter = CountingPieces(llm.engine.core.runner)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert counter.counts, "no prompt-carrying step replayed pieces"
    assert counter.padded > 0, "no step was padded to its bucket"
    assert llm.engine.core.block_manager.num_free == llm.engine.core.block_manager.num_blocks


def test_every_step_takes_one_path_by_one_rule(qwen3_model):
    """graphs_for: a decode step replays a decode graph, a step with a prompt chunk the smallest
    piece bucket that holds its tokens, a step larger than every bucket runs eagerly."""
    runner = with_pieces(LLM(qwen3_model, max_num_seqs=8, max_num_batched_tokens=40)).engine.core.runner
    assert runner.pieces.sizes == [16, 32, 40]
    assert runner.graphs_for([1, 1, 1]) == (True, None)
    assert runner.graphs_for([1, 1, 5]) == (False, 16)
    assert runner.graphs_for([17]) == (False, 32)
    assert runner.graphs_for([30, 1, 1, 1, 1, 1, 1, 1]) == (False, 40)
    assert runner.graphs_for([41]) == (False, None)
    assert runner.graphs_for([1] * 9) == (False, 16)  # more sequences than the decode graphs hold


def causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence's causal attention over the tokens of this forward (chapter 1)."""
    return attend(q, k, v, causal_mask(q.shape[0]))


@pytest.mark.parametrize("num_tokens", [1, 7, 16, 21, 32])
def test_a_replay_equals_the_eager_forward_on_the_real_rows(qwen3_model, num_tokens):
    """The pieces of the smallest bucket that holds T tokens, after a longer step left its rows
    in the buffers, give the eager forward's hidden states for those T tokens (the attention
    here is the causal one of a single sequence)."""
    runner = PiecewiseRunner(qwen3_model, torch.device("cpu"), 32, cuda=False)
    size = runner.bucket_for(num_tokens)
    generator = torch.Generator().manual_seed(num_tokens)
    longer = torch.randint(0, qwen3_model.config.vocab_size, (size,), generator=generator)
    ids = torch.randint(0, qwen3_model.config.vocab_size, (num_tokens,), generator=generator)
    positions = torch.arange(num_tokens)
    with torch.inference_mode():
        runner.replay(size, longer, torch.arange(size), causal)  # stale rows for the next step
        got = runner.replay(size, ids, positions, causal)
        expected = qwen3_model(ids, positions, causal)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_attention_sees_only_the_real_rows():
    """An AttentionSlot runs attention on the first T rows and leaves the padding rows' output
    as it was: a padding row never reaches attention (so never a KV cache)."""
    q, k, v = torch.randn(8, 2, 4), torch.randn(8, 1, 4), torch.randn(8, 1, 4)
    out = torch.full((8, 2, 4), 7.0)
    seen = []

    def attention(layer, q_, k_, v_):
        seen.append((layer, q_.shape[0], k_.shape[0], v_.shape[0]))
        return q_ * 2

    AttentionSlot(3, q, k, v, out).run(attention, 5)
    assert seen == [(3, 5, 5, 5)]
    assert torch.equal(out[:5], q[:5] * 2) and (out[5:] == 7).all()


def test_the_stand_in_pads_with_its_buffers(qwen3_model):
    pieces = EagerPieces(qwen3_model, 16, torch.device("cpu"))
    assert pieces.input_ids.shape == (16,) and pieces.positions.shape == (16,)


def test_piecewise_graphs_is_validated(qwen3_model):
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match="piecewise_graphs"):
            LLMEngine(qwen3_model, piecewise_graphs=bad)
    if not ON_GPU:
        assert LLMEngine(qwen3_model).core.runner.pieces is None  # chapter 7's engine on a CPU
        with pytest.raises(ValueError, match="piecewise_graphs=True needs cuda_graphs"):
            LLMEngine(qwen3_model, piecewise_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_captured_pieces_equal_the_eager_engine_in_fp32(hf_models, reference, fused):
    """Real capture: pieces of every bucket the steps reach, on CUDA in fp32, against
    transformers on the CPU; the pieces really replayed padded steps."""
    from minivllm import load_model

    model = load_model(hf_models["qwen3"], device="cuda", dtype=torch.float32)
    llm = LLM(model, attention="triton", cuda_graphs=True, piecewise_graphs=True, fused_ops=fused,
              async_scheduling=False, max_num_seqs=8, max_num_batched_tokens=64)
    counter = CountingPieces(llm.engine.core.runner)
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [reference(hf_models["qwen3"], p, n) for p, n in zip(PROMPTS, LENGTHS)]
    assert counter.counts and counter.padded > 0


def test_the_chapter_records_which_graphs_each_step_replays(qwen3_model, tmp_path):
    """graph_paths: a workload through decode graphs and pieces gives the eager engine's tokens,
    and its steps take both paths by the rule; the figure draws them and refuses unknown paths."""
    from minivllm.course import plots
    from minivllm.course.bench.graph_paths import graph_paths
    from minivllm.course.plots.pieces import plot_piecewise

    paths = graph_paths(qwen3_model, workload="tiny", num_requests=6, max_num_seqs=4, max_num_batched_tokens=32)
    assert paths["same_tokens_as_eager"]
    taken = {s["path"] for s in paths["steps"]}
    assert {"decode graph", "pieces"} <= taken, taken
    for s in paths["steps"]:
        assert (s["path"] == "pieces") == (s["bucket"] is not None)
        if s["bucket"] is not None:
            assert s["bucket"] == min(size for size in paths["piece_sizes"] if size >= s["tokens"])
    assert plots.save(plot_piecewise(paths["steps"], paths["piece_sizes"]), "pieces", tmp_path).exists()
    with pytest.raises(ValueError, match="unknown paths"):
        plot_piecewise([dict(tokens=3, path="full")], [16])
    with pytest.raises(ValueError):
        plot_piecewise([], [16])
