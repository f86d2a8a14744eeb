"""Chapter 16: async scheduling. With async_scheduling=True every output equals the synchronous
engine's, and greedy tokens equal transformers', under chunked prefill, preemption, prefix
caching, aborts, n-gram speculation, structured outputs, n > 1, logprobs, penalties, stop
strings, stop tokens and EOS; the extra token of a finished request is computed once and never
seen; placeholders never leak; the setting is checked like every other."""
from __future__ import annotations

import pytest
from tiny_models import random_prompts

from minivllm import LLM, LLMEngine, SamplingParams, load_model, load_tokenizer
from minivllm.core.async_scheduling import PLACEHOLDER
from minivllm.config.engine import EngineConfig
from minivllm.request.sampling_params import RequestOutputKind
from minivllm.core.trace import Trace

pytestmark = [pytest.mark.ch16, pytest.mark.timeout(240), pytest.mark.floors]

GREEDY = dict(temperature=0.0, ignore_eos=True)
STARVED = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=24)  # chunked prefill and preemption
PROMPTS = random_prompts([5, 17, 9, 30, 12, 23])
LENGTHS = [12, 8, 15, 10, 14, 9]


def completions(llm: LLM, prompts, params) -> list[list[tuple]]:
    """Everything a caller can see of each request's completions."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.cumulative_logprob)
             for c in out.outputs] + [out.prompt_logprobs] for out in outs]


def both(model, prompts, params, tokenizer=None, **settings) -> tuple[list, list]:
    """(synchronous, async) completions of the same requests on fresh engines."""
    runs = []
    for overlap in (False, True):
        llm = LLM(model, tokenizer=tokenizer, async_scheduling=overlap, **settings)
        assert (llm.engine.core.overlap is not None) == (overlap and "speculative_config" not in settings)
        runs.append(completions(llm, prompts, params))
    return runs[0], runs[1]


@pytest.mark.parametrize("settings", [{}, STARVED, dict(STARVED, enable_prefix_caching=True)],
                         ids=["default", "starved", "starved+prefix-cache"])
def test_greedy_equals_transformers_and_the_synchronous_engine(model, hf_model, reference, settings):
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS]
    sync, overlapped = both(model, PROMPTS, params, **settings)
    assert overlapped == sync
    assert [run[0][0] for run in overlapped] == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]


def test_prefix_caching_sees_no_placeholder(qwen3_model):
    """Requests that share a prefix, run twice: the second run finds the same cached tokens as
    the synchronous engine does, so no block was named after a placeholder."""
    shared = random_prompts([24], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts([3, 5, 7], seed=4)]
    hits = []
    for overlap in (False, True):
        llm = LLM(qwen3_model, block_size=4, enable_prefix_caching=True, async_scheduling=overlap)
        first = llm.generate(prompts, SamplingParams(max_tokens=9, **GREEDY), use_tqdm=False)
        again = llm.generate(prompts, SamplingParams(max_tokens=9, **GREEDY), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
        hits.append([o.num_cached_tokens for o in again])
    assert hits[1] == hits[0] and min(hits[0]) > 0


def test_sampling_n_logprobs_and_penalties_equal_the_synchronous_engine(qwen3_model):
    """Seeded sampling (each completion draws from its own generator), n = 3, logprobs and prompt
    logprobs, penalties, min_tokens: nothing depends on which step the host reads the tokens in."""
    params = [SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.4, frequency_penalty=0.3,
                             prompt_logprobs=1, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=8, min_tokens=6, presence_penalty=0.5)]
    sync, overlapped = both(qwen3_model, PROMPTS[:3], params)
    assert overlapped == sync


def test_stop_tokens_eos_and_stop_strings(hf_models, reference, default_model):
    hf_model = hf_models["llama"]
    full = reference(hf_model, PROMPTS[1], 20)
    eos = load_model(hf_model, device="cpu")
    eos.config.eos_token_ids = [full[6]]
    params = [SamplingParams(max_tokens=20, temperature=0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[full[3]])]
    sync, overlapped = both(eos, [PROMPTS[1]] * 3, params)
    assert overlapped == sync
    assert [run[0][:3] for run in overlapped] == [
        (full[:full.index(full[6]) + 1], "", "stop"), (full, "", "length"), (full[:full.index(full[3]) + 1], "", "stop")]
    # Stop strings need text: the embedded model and its tokenizer.
    tokenizer = load_tokenizer()
    prompts = ["def fibonacci(n):\n", "The capital of France is", "import numpy as np\n"]
    plain = LLM(default_model, tokenizer=tokenizer).generate(prompts, SamplingParams(max_tokens=24, temperature=0),
                                                              use_tqdm=False)
    stops = [out.outputs[0].text[5:8] for out in plain]  # strings each output really reaches
    params = [SamplingParams(max_tokens=24, temperature=0, stop=[stop], logprobs=1) for stop in stops]
    sync, overlapped = both(default_model, prompts, params, tokenizer=tokenizer)
    assert overlapped == sync
    assert all(run[0][2] == "stop" and run[0][3] == stop for run, stop in zip(overlapped, stops))


def test_a_stop_string_aborts_the_completion_in_the_core_and_its_token_in_flight_is_dropped(default_model):
    """The output processor finds a stop string in step N's text after the core launched step
    N+1 for that completion; the abort reaches the core before step N+1 is finished, and the
    core sends nothing more for it: no placeholder and no extra token ever leave the core."""
    tokenizer = load_tokenizer()
    prompt = "def fibonacci(n):\n"
    full = LLM(default_model, tokenizer=tokenizer).generate([prompt], SamplingParams(max_tokens=24, temperature=0),
                                                            use_tqdm=False)[0].outputs[0].text
    stop = full[5:8]
    engine = LLMEngine(default_model, tokenizer=tokenizer, async_scheduling=True)
    engine.add_request(request_id="s", prompt=prompt, params=SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    engine.add_request(request_id="other", prompt=prompt, params=SamplingParams(max_tokens=24, temperature=0))
    seq, sent, stopped_at = engine.core.requests["s"].seqs[0], [], None
    for step in range(60):
        news = engine.core.step()
        assert all(PLACEHOLDER not in out.new_token_ids for out in news)
        sent += [(step, out.request_id) for out in news]
        outputs, stopped = engine.output_processor.process_outputs(news)
        if stopped:
            assert stopped == [("s", 0)] and stopped_at is None
            assert seq in engine.core.overlap.in_flight.tokens.seqs, "no token was in flight: the check proves nothing"
            stopped_at = step
        engine.core.abort_sequences(stopped)
        if not engine.has_unfinished_requests():
            break
    assert stopped_at is not None and not engine.has_unfinished_requests()
    assert max(step for step, rid in sent if rid == "s") == stopped_at, "the core answered after the stop"
    assert seq.num_output_placeholders == 0 and PLACEHOLDER not in seq.token_ids
    assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


def test_ngram_speculation_runs_synchronously_and_exactly(model, hf_model, reference):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    params = [SamplingParams(max_tokens=n, **GREEDY) for n in LENGTHS]
    sync, overlapped = both(model, PROMPTS, params, speculative_config=spec, **STARVED)
    assert overlapped == sync
    assert [run[0][0] for run in overlapped] == [reference(hf_model, p, n) for p, n in zip(PROMPTS, LENGTHS)]


def test_structured_outputs_equal_the_synchronous_engine(default_model):
    pytest.importorskip("xgrammar")
    from minivllm import StructuredOutputsParams

    tokenizer = load_tokenizer()
    json_schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                   "required": ["name", "age"]}
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=json_schema)),
              SamplingParams(temperature=0, max_tokens=16),  # beside it, unconstrained
              SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))]
    prompts = ["user = ", "def main():\n", "Is the sky blue? Answer: "]
    sync, overlapped = both(default_model, prompts, params, tokenizer=tokenizer)
    assert overlapped == sync


def test_aborts_in_flight_and_the_extra_token_of_a_finished_request(qwen3_model, hf_models, reference):
    """Abort requests while their step is in flight: the others are untouched, the aborted ones
    never answer again, every block comes back. Each request that ran to its end computed
    exactly one token more than the synchronous engine (the step launched before its end was
    known), and that token never reached an output."""
    hf_model = hf_models["qwen3"]
    scheduled = []
    for overlap in (False, True):
        engine = LLMEngine(qwen3_model, async_scheduling=overlap, block_size=4, num_kv_blocks=64)
        engine.core.trace = Trace()
        for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
            engine.add_request(prompt=prompt, params=SamplingParams(max_tokens=n, output_kind=RequestOutputKind.CUMULATIVE,
                                                                    **GREEDY), request_id=str(i))
        finished, aborted = {}, {"1", "4"}
        for step in range(200):
            if step == 4:
                engine.abort_request(sorted(aborted))
            for out in engine.step():
                assert PLACEHOLDER not in out.outputs[0].token_ids
                assert step < 4 or out.request_id not in aborted, "an aborted request answered"
                assert out.request_id not in finished
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        assert sorted(finished) == sorted(set(map(str, range(len(PROMPTS)))) - aborted)
        for rid, tokens in finished.items():
            assert tokens == reference(hf_model, PROMPTS[int(rid)], LENGTHS[int(rid)])
        assert engine.core.block_manager.num_free == 64
        scheduled.append(sum(s.num_tokens for s in engine.core.trace.steps if not s.preempted))
    # The aborted requests ran in the same steps either way (aborted at the same step).
    assert scheduled[1] - scheduled[0] == len(PROMPTS) - len(aborted)


def test_the_setting_is_checked(qwen3_model):
    for bad in ("yes", 1, 0, 1.0):
        with pytest.raises(ValueError, match="async_scheduling"):
            EngineConfig(async_scheduling=bad)
    assert EngineConfig().resolve(qwen3_model).async_scheduling is False  # off on a CPU: nothing to overlap
    assert EngineConfig(async_scheduling=True).resolve(qwen3_model).async_scheduling is True
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2).resolve(qwen3_model)


def test_feed_writes_each_token_over_its_own_placeholder():
    """Exercise 16.2, focused: SampledTokens.feed writes the last step's token of each sequence
    over that sequence's placeholder, at query_start[i] + (num_tokens - 1 - num_computed_tokens):
    for a decode the first entry of its row, for a chunk that ends in its placeholder (a sequence
    recomputed after preemption) an entry inside its chunk. Nothing else of the buffer changes."""
    import numpy as np
    import torch

    from minivllm.request.sequence import Sequence
    from minivllm.worker.prepare import StepArrays
    from minivllm.worker.sampled_tokens import SampledTokens

    def seq(name: str, num_tokens: int, num_computed: int, placeholder: bool) -> Sequence:
        s = Sequence(name, list(range(num_tokens - placeholder)), SamplingParams(), 64)
        if placeholder:
            s.token_ids.append(PLACEHOLDER)
            s.num_output_placeholders = 1
        s.num_computed_tokens = num_computed
        return s

    decode = seq("decode", 7, 6, True)  # one row: its placeholder is its first and only entry
    chunk = seq("chunk", 10, 6, True)  # rows for positions 6..9: the placeholder is the 4th
    prefill = seq("prefill", 5, 0, False)  # no placeholder: untouched
    stranger = seq("stranger", 4, 3, True)  # a placeholder, but not a sequence of the step being fed
    seqs = [prefill, chunk, decode, stranger]
    lens = [5, 4, 1, 1]
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = int(starts[-1])
    empty = np.zeros(0, dtype=np.int64)
    arrays = StepArrays(np.zeros(T, dtype=np.int64), empty, empty, starts, empty, np.zeros((4, 0), dtype=np.int64),
                        empty, [])
    flat = torch.arange(100, 100 + T + 8)  # the input ids, then the rest of a packed step: must not change
    sampled = SampledTokens([decode, chunk], device=torch.tensor([7001, 7002]))  # rows: decode 0, chunk 1
    expected = flat.clone()
    expected[int(starts[2]) + 0] = 7001  # decode: query_start[2] + (7 - 1 - 6)
    expected[int(starts[1]) + 3] = 7002  # chunk: query_start[1] + (10 - 1 - 6)
    sampled.feed(seqs, arrays, flat)
    wrong = [i for i in range(len(flat)) if int(flat[i]) != int(expected[i])]
    assert not wrong, (
        "feed must write row j's token at query_start[i] + (seq.num_tokens - 1 - seq.num_computed_tokens), the "
        "entry of the placeholder inside sequence i's rows, only for sequences of the step being fed that have a "
        f"placeholder; here the decode's token belongs at flat[{int(starts[2])}] and the chunk's at "
        f"flat[{int(starts[1]) + 3}] (its 4th row, not its first). Entries that differ: "
        + ", ".join(f"flat[{i}] = {int(flat[i])}, expected {int(expected[i])}" for i in wrong))
