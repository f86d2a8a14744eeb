"""Chapter 7: the continuous-batching engine. Greedy tokens equal transformers' with default
settings and under starvation (chunked prefill + preemption); scheduler invariants under
random arrivals; EOS / stop tokens; bad input refused while the engine keeps serving;
streaming and abort."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest
from tiny_models import raises_runtime_error, random_prompts

from minivllm import LLM, LLMEngine, SamplingParams, load_model
from minivllm.core.trace import Trace
from minivllm.stages import STAGES
from minivllm.stages.common import StageStats

pytestmark = [pytest.mark.ch07, pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)
# Starvation: 4-token blocks, a pool far smaller than the batch needs at once, a 24-token budget.
STARVED = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=24)


PROMPTS = random_prompts([5, 17, 9, 30, 12, 23])
LENGTHS = [12, 8, 15, 10, 14, 9]


@pytest.fixture(scope="module")
def qwen3(qwen3_model, hf_models):
    """One family for the checks that are about scheduling, not about the model."""
    return qwen3_model, hf_models["qwen3"]


def greedy(llm: LLM, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in lengths]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_greedy_matches_transformers(model, hf_model, reference):
    llm = LLM(model)
    assert greedy(llm, PROMPTS, LENGTHS) == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]


def test_greedy_matches_transformers_under_starvation(model, hf_model, reference):
    llm = LLM(model, **STARVED)
    llm.trace = Trace()
    assert greedy(llm, PROMPTS, LENGTHS) == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    steps = llm.trace.steps
    assert llm.trace.num_preemptions > 0, "the settings were meant to force preemption"
    first_chunk: dict[str, int] = {}
    for s in steps:
        for rid, n in s.prefill.items():
            first_chunk.setdefault(rid, n)
    assert any(n < len(PROMPTS[int(rid)]) for rid, n in first_chunk.items()), "no prompt was chunked"
    assert all(s.num_tokens <= STARVED["max_num_batched_tokens"] for s in steps)
    assert llm.engine.core.block_manager.num_free == STARVED["num_kv_blocks"]


@pytest.mark.parametrize("seed", [0, 1])
def test_scheduler_invariants_under_random_arrivals(qwen3, reference, seed):
    model, hf_model = qwen3
    engine = LLMEngine(model, block_size=4, num_kv_blocks=16,
                       max_num_batched_tokens=16, max_num_seqs=5)
    engine.core.trace = Trace()
    rng = random.Random(seed)
    prompts = random_prompts([rng.randint(1, 30) for _ in range(10)], seed=seed)
    lengths = [rng.randint(4, 24) for _ in prompts]
    arrival_step = sorted(rng.randint(0, 40) for _ in prompts)
    manager, tokens, first_scheduled = engine.core.block_manager, {}, []
    for step in range(2000):
        for i, arrive in enumerate(arrival_step):
            if arrive == step:
                engine.add_request(prompt=prompts[i], params=SamplingParams(max_tokens=lengths[i], **GREEDY), request_id=str(i))
        done_before = len(engine.core.trace.steps)
        for out in engine.step():
            tokens[int(out.request_id)] = out.outputs[0].token_ids
        for record in engine.core.trace.steps[done_before:]:
            assert record.num_tokens <= 16
            first_scheduled += [int(r) for r in [*record.prefill, *record.decode] if int(r) not in first_scheduled]
        running, waiting = engine.core.scheduler.running, engine.core.scheduler.waiting
        assert len(running) <= 5
        owned = [b for seq in running for b in seq.block_table]
        assert len(owned) == len(set(owned)) and not set(owned) & set(manager.free)  # each block has one owner
        assert len(owned) + manager.num_free == manager.num_blocks
        assert all(not seq.block_table for seq in waiting)  # preempted requests gave everything back
        if step > max(arrival_step) and not engine.has_unfinished_requests():
            break
    else:
        pytest.fail("some request starved: the engine never emptied")
    assert first_scheduled == sorted(first_scheduled)  # first come, first served
    assert manager.num_free == manager.num_blocks
    assert engine.core.trace.num_preemptions > 0
    assert [tokens[i] for i in range(len(prompts))] == [reference(hf_model, p, n) for p, n in zip(prompts, lengths)]


def test_stage_counts_every_token_once_plus_recompute(qwen3, reference):
    model, hf_model = qwen3
    stats = StageStats()
    out = STAGES["continuous"](model, PROMPTS, LENGTHS, stats=stats, **STARVED)
    assert out == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]
    # Each request computes its prompt and all but its last output token, and the stage
    # reports recomputed tokens as waste.
    needed = sum(len(p) + n - 1 for p, n in zip(PROMPTS, LENGTHS))
    assert stats.token_slots == needed + stats.wasted_slots > needed
    assert 0 < stats.kv_used <= stats.kv_reserved and stats.peak_kv_tokens <= 14 * 4


def eos_model(hf_model, eos: int):
    model = load_model(hf_model, device="cpu")
    model.config.eos_token_ids = [eos]
    return model


def test_eos_and_stop_tokens(hf_models, reference):
    hf_model = hf_models["llama"]
    prompt = PROMPTS[1]
    full = reference(hf_model, prompt, 20)
    token = full[6]
    expected = full[:full.index(token) + 1]  # up to and including the first occurrence
    llm = LLM(eos_model(hf_model, token))
    stopped = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0]
    assert (stopped.token_ids, stopped.finish_reason) == (expected, "stop")
    ignored = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert (ignored.outputs[0].token_ids, ignored.outputs[0].finish_reason) == (full, "length")
    plain = LLM(load_model(hf_model, device="cpu"))
    stop = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[token])
    by_stop = plain.generate(prompt, stop, use_tqdm=False)[0].outputs[0]
    assert (by_stop.token_ids, by_stop.finish_reason) == (expected, "stop")


def test_output_stops_at_max_model_len(qwen3, reference):
    model, hf_model = qwen3
    # Documented choice (as vLLM): prompt + max_tokens may exceed max_model_len; generation
    # stops with finish_reason "length" when the sequence reaches max_model_len tokens.
    llm = LLM(model, max_model_len=20)
    out = llm.generate(PROMPTS[0] * 3, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (reference(hf_model, PROMPTS[0] * 3, 5), "length")


class CharTokenizer:
    """A stand-in tokenizer: one token per character (ids = ord(c) % 97)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 97 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 32) for i in ids)


def test_text_prompts_and_checkpoints_without_tokenizer(qwen3, reference):
    model, hf_model = qwen3
    with_text = LLM(model, tokenizer=CharTokenizer())
    out = with_text.generate("hello", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    ids = reference(hf_model, CharTokenizer().encode("hello"), 4)
    assert (out.prompt, out.outputs[0].token_ids, out.outputs[0].text) == ("hello", ids, CharTokenizer().decode(ids))
    no_text = LLM(hf_model)  # an in-memory transformers model: no tokenizer files
    out = no_text.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    assert (out.outputs[0].text, out.outputs[0].token_ids) == ("", reference(hf_model, PROMPTS[0], 4))
    with pytest.raises(ValueError, match="tokenizer"):
        no_text.generate("hello")


BAD_PROMPTS = {
    "empty": [],
    "negative id": [3, -1, 4],
    "id == vocab size": [3, 97, 4],
    "a bool id": [3, True, 4],  # an int to Python, not a token id
    "a float id": [3, 4.0],
    "a string id": [3, "4"],
    "longer than max_model_len": list(range(32)),
    "never fits in the pool": [1] * 20,  # up to 31 cached tokens: 8 four-token blocks, the pool has 6
}


@pytest.mark.parametrize("bad", list(BAD_PROMPTS))
def test_bad_input_is_refused_and_the_engine_keeps_serving(qwen3, reference, bad):
    model, hf_model = qwen3
    llm = LLM(model, block_size=4, num_kv_blocks=6, max_model_len=32)
    good = PROMPTS[0]
    with pytest.raises(ValueError):
        llm.generate([good, BAD_PROMPTS[bad], good], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # the good prompts before it were taken back
    assert llm.engine.core.block_manager.num_free == 6
    out = llm.generate(good, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference(hf_model, good, 5)


def test_token_ids_of_any_integer_type_give_the_same_tokens(qwen3, reference):
    """Plain ints take the fast check (by type); numpy's integers, a tuple, the slow one (numbers.Integral)."""
    model, hf_model = qwen3
    llm = LLM(model, block_size=4, num_kv_blocks=16, max_model_len=32)
    good, params = PROMPTS[0], SamplingParams(max_tokens=5, temperature=0)
    expected = reference(hf_model, good, 5)
    for prompt in (good, tuple(good), list(np.array(good, dtype=np.int64)), [np.int32(good[0]), *good[1:]]):
        out = llm.generate({"prompt_token_ids": prompt} if isinstance(prompt, tuple) else prompt, params,
                           use_tqdm=False)[0]
        assert out.prompt_token_ids == good and all(type(t) is int for t in out.prompt_token_ids)
        assert out.outputs[0].token_ids == expected


def test_bad_engine_settings(qwen3):
    model = qwen3[0]
    with pytest.raises(ValueError):
        LLM(model, max_model_len=model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError):
        LLM(model, max_num_batched_tokens=0)
    with pytest.raises(ValueError):
        LLM(model).generate([PROMPTS[0], PROMPTS[1]], [SamplingParams()])  # one params for two prompts


def test_streaming_steps_and_late_joiners(qwen3, reference):
    model, hf_model = qwen3
    engine = LLMEngine(model)
    engine.add_request(prompt=PROMPTS[3], params=SamplingParams(max_tokens=10, **GREEDY), request_id="early")
    seen: dict[str, list[list[int]]] = {"early": [], "late": []}
    finished: dict[str, int] = {}  # request id -> step it finished
    first_token: dict[str, int] = {}
    for step in range(100):
        if step == 3:  # arrives while "early" is decoding
            engine.add_request(prompt=PROMPTS[4], params=SamplingParams(max_tokens=6, **GREEDY), request_id="late")
        for out in engine.step():
            assert out.request_id not in finished
            seen[out.request_id].append(out.outputs[0].token_ids)
            first_token.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = step
        if not engine.has_unfinished_requests():
            break
    for rid, prompt, n in (("early", PROMPTS[3], 10), ("late", PROMPTS[4], 6)):
        assert [len(s) for s in seen[rid]] == list(range(1, n + 1))  # one new token per step
        assert seen[rid][-1] == reference(hf_model, prompt, n)
    assert first_token["late"] == 3 < finished["early"]  # joined at once, did not wait for "early"


def test_abort_frees_blocks_and_spares_the_others(qwen3, reference):
    model, hf_model = qwen3
    engine = LLMEngine(model, block_size=4, num_kv_blocks=32)
    engine.add_request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=12, **GREEDY), request_id="keep")
    engine.add_request(prompt=PROMPTS[1], params=SamplingParams(max_tokens=12, **GREEDY), request_id="drop")
    engine.step()
    engine.step()
    engine.abort_request("drop")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"keep"}
    assert outputs[-1].outputs[0].token_ids == reference(hf_model, PROMPTS[0], 12)
    assert engine.core.block_manager.num_free == 32


def test_online_simulation_continuous_vs_static(qwen3):
    from minivllm.course.bench.online import latency_summary, serve_continuous, serve_static
    from minivllm.course.bench.workloads import Workload

    work = Workload("four at once", PROMPTS[:4], [6, 2, 5, 3], arrivals=[0.0] * 4)
    engine = LLMEngine(qwen3[0], max_num_seqs=4)
    together = serve_continuous(engine, work)
    in_pairs = serve_static(engine, work, batch_size=2)
    for timings in (together, in_pairs):
        assert [len(t.token_times) for t in timings] == work.output_lens
        assert all(t.token_times == sorted(t.token_times) and t.ttft > 0 for t in timings)
    assert len({t.token_times[0] for t in together}) == 1  # continuous: all four start in the first step
    # static: the second pair starts only after the first pair's longest request is done
    assert min(t.token_times[0] for t in in_pairs[2:]) > max(t.token_times[-1] for t in in_pairs[:2])
    summary = latency_summary(together)
    assert summary["ttft"]["p50"] <= summary["e2e"]["p50"] and summary["throughput"]["useful_tokens_per_second"] > 0
    assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


def test_metrics_time_the_first_token_and_the_finish(qwen3):
    engine = LLMEngine(qwen3[0])
    for prompt, n in zip(PROMPTS, LENGTHS):
        engine.add_request(prompt=prompt, params=SamplingParams(max_tokens=n, **GREEDY))
    first_step: dict[str, tuple[float, float]] = {}  # request -> (before, after) the step of its first token
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        outputs = engine.step()
        after = time.perf_counter()
        for out in outputs:
            start, end = first_step.setdefault(out.request_id, (before, after))
            m = out.metrics
            assert m.arrival_time <= start <= m.first_token_time <= end  # every output reports the first token's time
            assert (m.finished_time is not None) == out.finished
            if out.finished:
                assert before <= m.finished_time <= after
    assert len(first_step) == len(PROMPTS)


@pytest.mark.timeout(30, func_only=True)  # fixtures built once per session are not timed
def test_a_schedule_that_plans_nothing_fails_at_once_instead_of_hanging(qwen3, monkeypatch):
    """A wrong Scheduler.schedule that grants no token (and preempts nobody) while requests wait
    must stop the engine with an error, not leave LLM.generate stepping forever."""
    from minivllm.core.scheduler import Scheduler
    from minivllm.request.sequence import SchedulerOutput

    monkeypatch.setattr(Scheduler, "schedule", lambda self: SchedulerOutput())
    with raises_runtime_error("schedule"):
        LLM(qwen3[0]).generate(PROMPTS[0], SamplingParams(max_tokens=3, **GREEDY), use_tqdm=False)
