"""Chapter 12 on a GPU: verify steps (and the draft's own steps) replayed from graphs, on the CPU.

There are no CUDA graphs on a CPU, so the runners use `EagerGraph` (chapter 9's stand-in: the
same static buffers, buckets and padding, a replay that calls the captured forward again). A
verify step replays the graph of its (batch-size bucket, 1 + k) with every sequence padded to
1 + k rows; greedy tokens must stay transformers' own for n-gram and draft-model speculation,
every k, with prefix caching, n = 2, stop strings and logprobs, and the counters prove that the
verify graphs really ran. The real capture is the GPU runbook's (`gpu` marker).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_ch12_spec_decode import GREEDY, LENGTHS, PROMPTS, STARVED, check_blocks, run_checked, tiny_draft
from tiny_models import make_seq, random_prompts

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.worker.cuda_graphs import GraphRunner
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.prepare import build_step_arrays
from minivllm.core.spec_decode.draft_model import DraftModelProposer

pytestmark = [pytest.mark.ch12, pytest.mark.floors]


def graphed(engine: LLMEngine) -> LLMEngine:
    """The engine with runners that replay graphs (EagerGraph on a CPU): the target's, keyed by
    (bucket, 1) and (bucket, 1 + k), and a draft model's, keyed by (bucket, 1) and (bucket, 2).
    Call it before the first request: the new runners bring empty KV pools."""
    config = dataclasses.replace(engine.config, cuda_graphs=True)
    engine.core.runner = ModelRunner(engine.model, config)
    proposer = engine.core.speculator.proposer if engine.core.speculator is not None else None
    if isinstance(proposer, DraftModelProposer):
        draft = dataclasses.replace(config, num_kv_blocks=proposer.blocks.num_blocks)
        proposer.runner = ModelRunner(proposer.model, draft, graph_query_lens=(1, 2))
    return engine


class Replays:
    """Counts the replays of every graph of a runner, by key."""

    def __init__(self, runner: ModelRunner):
        self.counts: dict = {}
        for key, graph in runner.graphs.graphs.items():
            def counted(key=key, replay=graph.replay):
                self.counts[key] = self.counts.get(key, 0) + 1
                replay()

            graph.replay = counted

    def of_query_len(self, q: int) -> int:
        return sum(n for key, n in self.counts.items() if (key[1] if isinstance(key, tuple) else 1) == q)


def spec_config(method: str, k: int, model, hf_model) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {"model": model if method == "self" else tiny_draft(hf_model), "num_speculative_tokens": k}


# ---------------------------------------------------------------------------------------------
# The padded layout
# ---------------------------------------------------------------------------------------------


def test_a_verify_step_is_padded_to_equal_rows_that_touch_only_the_spare_block():
    """Sequence a: 1 real token + 2 guesses (3 of 4 rows real); b: a lone token (1 of 4); then a
    padding sequence. Padding tokens feed id 0 at their sequence's last real position, write the
    spare block's first slot, are never sampled; contexts count all 4 rows, and the table columns
    those rows reach past a sequence's own blocks read the spare block."""
    a = make_seq("a", [5, 6, 7, 8, 9], 2, [4, 2])  # tokens 2..4 in this step: 7 and its guesses 8, 9
    a.num_spec_tokens = 2
    b = make_seq("b", [1, 2], 1, [9])
    arrays = build_step_arrays([a, b], [3, 1], block_size=4, num_rows=3, pad_block=11, query_len=4)
    assert arrays.input_ids.tolist() == [7, 8, 9, 0, 2, 0, 0, 0, 0, 0, 0, 0]
    assert arrays.positions.tolist() == [2, 3, 4, 4, 1, 1, 1, 1, 0, 0, 0, 0]
    assert arrays.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 2 * 4 + 0, 44, 9 * 4 + 1, 44, 44, 44, 44, 44, 44, 44]
    assert arrays.query_start.tolist() == [0, 4, 8, 12] and arrays.context_lens.tolist() == [6, 5, 4]
    assert arrays.block_tables.tolist() == [[4, 2], [9, 11], [11, -1]]
    assert arrays.samplers == [0, 1] and arrays.sample_rows.tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="does not fit"):
        build_step_arrays([a, b], [3, 1], block_size=4, num_rows=3, pad_block=11, query_len=2)
    with pytest.raises(ValueError, match="pad_block"):
        build_step_arrays([a, b], [3, 1], block_size=4, query_len=4)


def test_can_run_takes_steps_up_to_the_longest_query_captured(qwen3_model):
    engine = graphed(LLMEngine(qwen3_model, max_num_seqs=4, speculative_config={"method": "ngram",
                                                                                "num_speculative_tokens": 3}))
    graphs = engine.core.runner.graphs
    assert graphs.query_lens == [1, 4] and {4, 1, (4, 4), (1, 4)} <= set(graphs.graphs)
    assert graphs.can_run([1, 1, 1]) and graphs.can_run([4, 1, 2]) and graphs.can_run([2])
    assert not graphs.can_run([5, 1]) and not graphs.can_run([1] * 5) and not graphs.can_run([])
    assert graphs.query_len_for([1, 3, 2]) == 4 and graphs.query_len_for([1, 1]) == 1
    with pytest.raises(ValueError, match="query_lens"):
        GraphRunner(engine.core.runner.forward, engine.core.runner.pool, engine.core.runner.attention_class, 4, 64,
                    query_lens=(2, 4))


# ---------------------------------------------------------------------------------------------
# The engine: transformers' greedy tokens with every verify step replayed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "self"])
def test_replayed_verify_steps_give_transformers_tokens(qwen3_model, hf_models, reference, method, k):
    """Starved (tiny blocks, preemption, a budget that cuts verify chunks, odd buckets): every
    request ends with transformers' greedy tokens, the verify graphs ran, and so did the draft's
    ("self": the target drafts for itself, so every guess is kept and the draft catches up on its
    last guess and the bonus token, 2 rows)."""
    hf_model = hf_models["qwen3"]
    engine = graphed(LLMEngine(qwen3_model, speculative_config=spec_config(method, k, qwen3_model, hf_model),
                               enable_prefix_caching=False, **STARVED))
    target = Replays(engine.core.runner)
    draft = Replays(engine.core.speculator.proposer.runner) if method != "ngram" else None
    outputs = run_checked(engine, PROMPTS, LENGTHS, GREEDY)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert outputs[str(i)].outputs[0].token_ids == reference(hf_model, prompt, n), f"request {i}"
    assert engine.core.speculator.stats.num_draft_tokens > 0
    assert target.of_query_len(1 + k) > 0, f"no verify step replayed a graph: {target.counts}"
    if draft is not None:
        assert draft.of_query_len(1) + draft.of_query_len(2) > 0, "the draft never replayed a graph"
        assert method != "self" or draft.of_query_len(2) > 0, f"the draft's replays: {draft.counts}"
    assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_replayed_verify_steps_with_prefix_caching(qwen3_model, hf_models, reference, method):
    system = random_prompts([9], seed=4)[0]
    prompts = [system + p for p in random_prompts([3, 6, 1, 8], seed=5)] + [system]
    lengths = [16, 12, 20, 9, 14]
    engine = graphed(LLMEngine(qwen3_model, speculative_config=spec_config(method, 3, qwen3_model, None),
                               enable_prefix_caching=True, **STARVED))
    replays = Replays(engine.core.runner)
    outputs = run_checked(engine, prompts, lengths, GREEDY)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        assert outputs[str(i)].outputs[0].token_ids == reference(hf_models["qwen3"], prompt, n), f"request {i}"
    assert engine.core.block_manager.hit_tokens > 0 and replays.of_query_len(4) > 0


def test_two_completions_logprobs_and_stops_with_replayed_verify_steps(qwen3_model, hf_models, reference):
    """n = 2 (top_k = 1: both greedy), logprobs equal to plain decoding's, and a stop token and
    max_tokens inside an accepted run, all with the target drafting for itself (every guess kept)."""
    spec = {"model": qwen3_model, "num_speculative_tokens": 4}
    llm = LLM(qwen3_model, speculative_config=spec, block_size=4, max_num_batched_tokens=9, max_num_seqs=3)
    graphed(llm.engine)
    replays = Replays(llm.engine.core.runner)
    params = SamplingParams(n=2, temperature=0.8, top_k=1, max_tokens=15, ignore_eos=True, seed=3)
    for prompt, request in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert [c.token_ids for c in request.outputs] == [reference(hf_models["qwen3"], prompt, 15)] * 2
    plain = LLM(qwen3_model)
    full = plain.generate(PROMPTS[1], SamplingParams(max_tokens=30, **GREEDY), use_tqdm=False)[0].outputs[0]
    for params in (SamplingParams(max_tokens=30, stop_token_ids=[full.token_ids[11]], **GREEDY),
                   SamplingParams(max_tokens=13, logprobs=3, **GREEDY)):
        expected = plain.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.token_ids, expected.finish_reason, expected.stop_reason), params
        for a, b in zip(got.logprobs or [], expected.logprobs or []):
            assert list(a) == list(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert replays.of_query_len(5) > 0
    check_blocks(llm.engine)


def test_stop_strings_on_the_embedded_model_with_replayed_verify_steps(default_model, chat_tokenizer):
    """Real text: n-gram guesses on repetitive code, a stop string inside an accepted run."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
    plain = LLM(default_model, tokenizer=chat_tokenizer)
    text = plain.generate(prompt, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0].text
    stop = text.strip()[3:6]
    llm = LLM(default_model, tokenizer=chat_tokenizer, max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    graphed(llm.engine)
    replays = Replays(llm.engine.core.runner)
    for params in (SamplingParams(max_tokens=24, temperature=0, stop=[stop]),
                   SamplingParams(max_tokens=24, temperature=0, stop=[stop], include_stop_str_in_output=True)):
        expected = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason)
        assert got.finish_reason == "stop"
    assert llm.engine.core.speculator.stats.num_accepted_tokens > 0 and replays.of_query_len(5) > 0


def test_replayed_and_eager_verify_steps_agree_on_sampled_tokens(qwen3_model, hf_models):
    """Seeded sampling with a draft that disagrees: the verify step's logits, replayed or eager,
    choose the same tokens."""
    spec = {"model": tiny_draft(hf_models["qwen3"]), "num_speculative_tokens": 3}
    params = [SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=i) for i, n in enumerate(LENGTHS)]
    eager = LLM(qwen3_model, speculative_config=spec, max_num_seqs=4)
    replayed = LLM(qwen3_model, speculative_config=spec, max_num_seqs=4)
    graphed(replayed.engine)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
              for llm in (eager, replayed)]
    assert tokens[0] == tokens[1]


def test_replayed_verify_steps_with_triton_attention_give_transformers_tokens(triton_interpreter, qwen3_model, hf_models,
                                                                           reference):
    """Through chapter 8's kernels (Triton's interpreter on a CPU; on a GPU the `gpu` check below
    captures them for real): prompt lookup (k = 3) with graphs on, so every verify step replays the
    (bucket, 4) graph and runs the decode kernel with 4 query rows per sequence."""
    prompts, lengths = [[5, 17, 9, 30, 12, 23, 3, 41, 7, 66, 2], [88, 4], [19, 60, 33, 8, 71]], [12, 10, 9]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = graphed(LLMEngine(qwen3_model, attention="triton", max_num_seqs=3, speculative_config=spec, block_size=4,
                               num_kv_blocks=32, max_num_batched_tokens=8))
    replays = Replays(engine.core.runner)
    outputs = run_checked(engine, prompts, lengths, GREEDY)
    assert [outputs[str(i)].outputs[0].token_ids for i in range(3)] == [
        reference(hf_models["qwen3"], p, n) for p, n in zip(prompts, lengths)]
    assert replays.of_query_len(4) > 0, f"no verify step replayed: {replays.counts}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["ngram", "self"])
def test_captured_verify_graphs_give_transformers_tokens(hf_models, reference, method):
    """Real capture (fp32, Triton attention): the verify graphs and the draft's, on CUDA."""
    import minivllm

    hf_model = hf_models["qwen3"]
    model = minivllm.load_model(hf_model, device="cuda", dtype=torch.float32)
    spec = spec_config(method, 4, model, None)
    engine = LLMEngine(model, speculative_config=spec, attention="triton", cuda_graphs=True, fused_ops=False,
                       enable_prefix_caching=False, max_num_seqs=3)
    replays = Replays(engine.core.runner)
    outputs = run_checked(engine, PROMPTS, LENGTHS, GREEDY)
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert outputs[str(i)].outputs[0].token_ids == reference(hf_model, prompt, n), f"request {i}"
    assert replays.of_query_len(5) > 0
