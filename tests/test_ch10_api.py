"""Chapter 10: the API vLLM users expect, each feature against a reference that can fail.

Penalties against a greedy loop over transformers' logits with the penalties written out in
float64 (and transformers' own RepetitionPenaltyLogitsProcessor, MinPLogitsWarper and
min_new_tokens); logprobs and prompt logprobs against log_softmax of transformers' logits;
stop strings across token boundaries with a tokenizer whose boundaries we control and with the
default model's byte-level BPE; n completions against n separately seeded requests; aborting
an n > 1 request frees every block; prompts as dicts, chat templates, request ids; bad input
refused with ValueError.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import random_prompts
from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

import minivllm
from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from minivllm.worker.penalties import apply_penalties
from minivllm.worker.sampler import Sampler, apply_min_p
from minivllm.request.sampling_params import RequestOutputKind
from minivllm.request.sequence import Sequence

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

PROMPT = [5, 17, 33, 2, 60, 41, 8, 17, 33, 5, 90, 12]
PROMPTS = random_prompts([9, 14, 6], seed=3)


@pytest.fixture(scope="module")
def qwen3(qwen3_model, hf_models):
    return qwen3_model, hf_models["qwen3"]


@pytest.fixture(scope="module")
def default_model():
    """The embedded model and its byte-level BPE tokenizer (4,096 tokens, Python code)."""
    return minivllm.load_model(device="cpu"), minivllm.load_tokenizer()


class CharTokenizer:
    """One token per character (ids = ord(c) % 97): token boundaries are character boundaries."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 97 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 32) for i in ids)


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits in float64: row j predicts token j + 1."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


# ---- Exercise 10.2: stop strings across token boundaries ----

def test_find_stop_string_sees_a_stop_string_that_spans_the_old_and_the_new_text():
    assert find_stop_string("abcXY", 1, ["XY"]) == (3, "XY")  # "X" came last step, "Y" now
    assert find_stop_string("ab\n\nc", 2, ["\n\n"]) == (2, "\n\n")
    assert find_stop_string("stop here", 9, ["here", "stop"]) == (0, "stop")  # the earliest start wins
    assert find_stop_string("xxabc", 3, ["abc", "ab"]) == (2, "abc")  # same start: the one listed first
    assert find_stop_string("abcdef", 2, ["def", "cd"]) == (3, "def")


def test_find_stop_string_never_looks_further_back_than_it_must():
    # "XY" wholly in the old text was already searched (and, say, ignored under min_tokens).
    assert find_stop_string("XY...", 3, ["XY"]) is None
    assert find_stop_string("XY..", 1, ["XY", "."]) == (3, ".")
    assert find_stop_string("abc", 0, ["c"]) is None
    assert find_stop_string("", 0, ["a"]) is None


def test_incremental_detokenizer_equals_decode_and_never_shows_half_a_character(default_model):
    _, tokenizer = default_model
    text = 'def f(x):\n    return "héllo 世界 🙂" + x  # ünïcödé\n'
    prompt, output = tokenizer.encode("print(1)\n"), tokenizer.encode(text)
    detok, shown = IncrementalDetokenizer(tokenizer, prompt), []
    for token in output:
        detok.add([token])
        assert "\ufffd" not in detok.text
        shown.append(detok.text)
    assert all(shown[i + 1].startswith(shown[i]) for i in range(len(shown) - 1))  # text only grows
    assert detok.text == tokenizer.decode(output) == text
    assert len(set(shown)) < len(shown)  # some tokens were half a character and waited
    half = IncrementalDetokenizer(tokenizer, prompt)
    half.add(tokenizer.encode("é")[:1], final=True)  # finished mid-character: shows what it has
    assert half.text == "\ufffd"


def stop_case(text: str, ids: list[int], stop: str, decode) -> tuple[str, list[int]]:
    """What a request must return when it stops at `stop`: the text before its first occurrence
    and the tokens up to the one that completed it."""
    t = next(t for t in range(1, len(ids) + 1) if stop in decode(ids[:t]))
    return text[:text.index(stop)], ids[:t]


def test_stop_strings_across_character_tokens(qwen3, reference):
    model, hf_model = qwen3
    tok = CharTokenizer()
    llm = LLM(model, tokenizer=tok)
    prompt = tok.decode(PROMPT)
    full = reference(hf_model, tok.encode(prompt), 24)
    text = tok.decode(full)
    stop = text[6:9]  # three characters, so three tokens
    want_text, want_ids = stop_case(text, full, stop, tok.decode)
    params = SamplingParams(max_tokens=24, temperature=0, stop=["never", stop])
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (want_text, want_ids, "stop", stop)
    kept = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == want_text + stop and kept.token_ids == want_ids


def test_stop_strings_across_bpe_tokens_and_streamed_text_is_never_taken_back(default_model):
    model, tokenizer = default_model
    engine = LLMEngine(model, tokenizer=tokenizer, num_kv_blocks=64)
    prompt = "import os\n\ndef list_files(path):\n    return"
    free = LLM(model, tokenizer=tokenizer, num_kv_blocks=64).generate(
        prompt, SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
    pieces = [tokenizer.decode(free.token_ids[:t]) for t in range(len(free.token_ids) + 1)]
    # A stop string made of the last two characters of one token and the first two of the next.
    def spanning(t: int) -> str | None:  # 2 characters of token t - 1 and 2 of token t, found nowhere earlier
        if len(pieces[t]) - len(pieces[t - 1]) < 2 or len(pieces[t + 1]) - len(pieces[t]) < 2:
            return None
        stop = pieces[t][-2:] + pieces[t + 1][len(pieces[t]):len(pieces[t]) + 2]
        return stop if free.text.index(stop) == len(pieces[t]) - 2 else None

    stop = next(s for s in map(spanning, range(3, 39)) if s)
    want_text, want_ids = stop_case(free.text, free.token_ids, stop, tokenizer.decode)
    engine.add_request(prompt=prompt, params=SamplingParams(max_tokens=40, temperature=0, stop=stop), request_id="r")
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [out.outputs[0] for out in engine.step()]
    last = streamed[-1]
    assert (last.text, last.token_ids, last.finish_reason, last.stop_reason) == (want_text, want_ids, "stop", stop)
    assert all(want_text.startswith(c.text) for c in streamed)  # nothing shown was taken back by the cut


# ---- penalties, min_p, min_tokens ----

def penalised_greedy(hf_model, prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    """Greedy decoding over transformers' logits with vLLM's penalties written out in float64."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].double()
        for t in set(ids):  # repetition: every token of the prompt and the output so far
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, count in Counter(out).items():  # frequency and presence: the output only
            logits[t] -= frequency * count + presence
        out.append(int(logits.argmax()))
        ids.append(out[-1])
    return out


PENALTIES = [dict(repetition_penalty=1.8), dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
             dict(repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=1.0)]


@pytest.mark.parametrize("penalties", PENALTIES, ids=[",".join(p) for p in PENALTIES])
def test_penalties_match_a_direct_computation_on_transformers_logits(qwen3, penalties):
    model, hf_model = qwen3
    names = {"repetition_penalty": "repetition", "presence_penalty": "presence", "frequency_penalty": "frequency"}
    want = [penalised_greedy(hf_model, p, 14, **{names[k]: v for k, v in penalties.items()}) for p in [PROMPT, *PROMPTS]]
    plain = [penalised_greedy(hf_model, p, 14) for p in [PROMPT, *PROMPTS]]
    assert want != plain, "the penalty should change the tokens"
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, **penalties)
    for llm in (LLM(model), LLM(model, block_size=4, num_kv_blocks=14, max_num_batched_tokens=12)):  # + preemption
        got = [o.outputs[0].token_ids for o in llm.generate([PROMPT, *PROMPTS], params, use_tqdm=False)]
        assert got == want


def test_repetition_penalty_equals_transformers_generate(qwen3):
    model, hf_model = qwen3
    ids = torch.tensor([PROMPT])
    hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False, repetition_penalty=1.7)[0, len(PROMPT):].tolist()
    ours = LLM(model).generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.7),
                               use_tqdm=False)[0].outputs[0].token_ids
    assert ours == hf


def test_penalty_functions_against_transformers_and_float64():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 3
    history = [[1, 2, 2, 7], [5, 5, 5], [0, 39, 12, 12]]  # prompt + output, as transformers sees input_ids
    prompt_len = [2, 1, 3]
    in_prompt = torch.zeros(3, 40, dtype=torch.bool)
    counts = torch.zeros(3, 40, dtype=torch.int32)
    for r, h in enumerate(history):
        in_prompt[r, h[:prompt_len[r]]] = True
        for t in h[prompt_len[r]:]:
            counts[r, t] += 1
    rep = torch.tensor([1.3, 0.5, 2.0])
    ours = apply_penalties(logits, in_prompt, counts, torch.zeros(3), torch.zeros(3), rep)
    for r, h in enumerate(history):
        theirs = RepetitionPenaltyLogitsProcessor(float(rep[r]))(torch.tensor([h]), logits[r:r + 1].clone())
        torch.testing.assert_close(ours[r], theirs[0])
    presence, frequency = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([0.25, 1.5, -0.5])
    ours = apply_penalties(logits, in_prompt, counts, presence, frequency, torch.ones(3))
    want = logits.double() - frequency[:, None].double() * counts - presence[:, None].double() * (counts > 0)
    torch.testing.assert_close(ours.double(), want)


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_min_p_keeps_what_transformers_keeps(min_p):
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(5)) * 2
    ours = apply_min_p(logits, torch.full((4,), min_p))
    theirs = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), logits.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())
    probs = logits.double().softmax(-1)  # and the definition itself, in float64
    assert torch.equal(~ours.isinf(), probs >= min_p * probs.amax(-1, keepdim=True))


def test_penalised_sampling_follows_the_penalised_softmax():
    """Sampled rows with penalties, counted from the sequences' own token lists, draw from
    softmax(penalised logits / T): the distribution written out here in float64."""
    logits = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, 0.0, -0.5, -1.0])
    params = SamplingParams(temperature=0.8, presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.5,
                            max_tokens=100)
    prompt, output, draws = [0, 4], [1, 1, 6], 20_000
    generator = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(draws):
        seq = Sequence(str(i), prompt, params, max_model_len=100)
        seq.token_ids += output
        seq.generator = generator
        seqs.append(seq)
    tokens = Sampler()(logits.expand(draws, -1), seqs, set()).token_ids
    want = logits.double()
    for t in set(prompt + output):
        want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
    for t, c in Counter(output).items():
        want[t] -= 0.3 * c + 0.6
    want = (want / 0.8).softmax(-1)
    freq = torch.bincount(torch.tensor(tokens), minlength=8).double() / draws
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


def test_min_tokens_holds_back_eos_and_stop_tokens_like_transformers(hf_models):
    hf_model = hf_models["llama"]
    prompt = PROMPTS[1]
    ids = torch.tensor([prompt])
    free = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                             do_sample=False)[0, len(prompt):].tolist()
    eos = free[2]  # greedy would stop after 3 tokens
    model = minivllm.load_model(hf_model, device="cpu")
    model.config.eos_token_ids = [eos]
    llm = LLM(model)
    for min_tokens in (0, 5, 12):
        hf = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=min_tokens,
                               do_sample=False, eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
        hf = hf[:hf.index(eos) + 1] if eos in hf else hf
        out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, min_tokens=min_tokens),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == hf and len(hf) >= min_tokens
        assert eos not in out.token_ids[:min_tokens]
    plain = LLM(minivllm.load_model(hf_model, device="cpu"))  # the same token as a stop token id
    out = plain.generate(prompt, SamplingParams(max_tokens=20, temperature=0, min_tokens=5, stop_token_ids=[eos]),
                         use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:5] and (out.finish_reason, out.stop_reason) in (("stop", eos), ("length", None))


# ---- logprobs ----

def check_position(entry: dict, reference_row: torch.Tensor, token: int, k: int) -> None:
    """One position's dict against the reference log_softmax row: the chosen token's logprob
    and rank, and the top k tokens with theirs."""
    assert token in entry and len(entry) in (k, k + 1)
    assert entry[token].logprob == pytest.approx(float(reference_row[token]), abs=1e-4)
    assert entry[token].rank == 1 + int((reference_row > reference_row[token] + 1e-6).sum())
    top = reference_row.topk(k)
    assert set(entry) - {token} <= set(top.indices.tolist()) and set(top.indices.tolist()) <= set(entry)
    for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert (entry[t].logprob, entry[t].rank) == (pytest.approx(value, abs=1e-4), rank)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_transformers_logits(qwen3, temperature):
    model, hf_model = qwen3
    k = 3
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=2, logprobs=k, ignore_eos=True)
    llm = LLM(model, tokenizer=CharTokenizer())
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    reference = hf_logprobs(hf_model, PROMPT + out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 10
    for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        check_position(entry, reference[len(PROMPT) + t - 1], token, k)
        assert entry[token].decoded_token == CharTokenizer().decode([token])
    chosen = [float(reference[len(PROMPT) + t - 1, tok]) for t, tok in enumerate(out.token_ids)]
    assert out.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-3)
    if temperature:
        assert any(e[tok].rank > 1 for tok, e in zip(out.token_ids, out.logprobs)), "sampled, yet always the top token"


def test_prompt_logprobs_in_chunks_and_with_n_completions(qwen3):
    model, hf_model = qwen3
    prompt = random_prompts([30], seed=9)[0]
    reference = hf_logprobs(hf_model, prompt)
    for params in (SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2),
                   SamplingParams(max_tokens=2, temperature=1.0, n=3, seed=1, prompt_logprobs=0)):
        llm = LLM(model, max_num_batched_tokens=8)  # the prompt is computed 8 tokens at a time
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            check_position(out.prompt_logprobs[p], reference[p - 1], prompt[p], params.prompt_logprobs)
    assert llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None


def test_greedy_tokens_equal_transformers_with_logprobs_asked_and_tiny_temperatures(model, hf_model, reference):
    llm = LLM(model)
    want = [reference(hf_model, p, 8) for p in PROMPTS]
    unused = next(t for t in range(97) if all(t not in w for w in want))  # forbidding it changes nothing
    for params in (SamplingParams(max_tokens=8, temperature=0, logprobs=2),
                   SamplingParams(max_tokens=8, temperature=1e-30, top_k=-1, min_p=0.3),
                   SamplingParams(max_tokens=8, temperature=0, min_tokens=8, stop_token_ids=[unused])):
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want


# ---- n completions ----

def test_n_seeded_completions_are_reproducible_distinct_and_each_a_seeded_request(qwen3):
    model, _ = qwen3
    llm = LLM(model)
    params = SamplingParams(n=4, temperature=1.2, seed=11, max_tokens=10, ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    runs = [[c.token_ids for c in out.outputs]]
    busy = LLM(model, block_size=4, num_kv_blocks=20, max_num_batched_tokens=10)  # chunks and preemptions
    noisy = SamplingParams(temperature=1.0, max_tokens=7)
    again = busy.generate([PROMPTS[0], PROMPT, PROMPTS[1]], [noisy, params, noisy], use_tqdm=False)[1]
    runs.append([c.token_ids for c in again.outputs])
    # Completion i is the request with seed 11 + i (how child seeds derive, documented on SamplingParams).
    alone = [llm.generate(PROMPT, SamplingParams(temperature=1.2, seed=11 + i, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids for i in range(4)]
    assert runs[0] == runs[1] == alone
    assert len({tuple(c) for c in runs[0]}) == 4  # distinct


def test_aborting_an_n_request_frees_every_block_and_spares_the_others(qwen3, reference):
    model, hf_model = qwen3
    engine = LLMEngine(model, block_size=4, num_kv_blocks=40)
    engine.add_request(prompt=PROMPT, params=SamplingParams(n=4, temperature=1.0, max_tokens=30, ignore_eos=True), request_id="many")
    engine.add_request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), request_id="keep")
    for _ in range(3):
        engine.step()
    children = engine.core.requests["many"].seqs
    assert all(seq.block_table for seq in children)
    engine.abort_request("many")
    assert all(seq.finish_reason == "abort" and not seq.block_table for seq in children)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {"keep"}
    assert outputs[-1].outputs[0].token_ids == reference(hf_model, PROMPTS[0], 12)
    assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


def test_a_request_finishes_when_all_its_completions_do(qwen3):
    engine = LLMEngine(qwen3[0])
    engine.add_request(prompt=PROMPT, params=SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True,
                                              stop_token_ids=list(range(0, 97, 2))), request_id="r")
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert all(not o.finished for o in seen[:-1]) and seen[-1].finished
    assert all(len(o.outputs) == 2 for o in seen)
    for c in seen[-1].outputs:
        assert c.finish_reason == ("stop" if c.token_ids[-1] % 2 == 0 else "length")


# ---- prompts, chat, request ids, output kinds ----

def test_dict_prompts_equal_plain_prompts(qwen3):
    llm = LLM(qwen3[0], tokenizer=CharTokenizer())
    params = SamplingParams(max_tokens=5, temperature=0)
    plain = llm.generate(["hello", PROMPT], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    single = llm.generate({"prompt": "hello"}, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in dicts]
    assert single[0].outputs[0].token_ids == plain[0].outputs[0].token_ids and single[0].prompt == "hello"
    assert llm.get_tokenizer() is llm.engine.tokenizer


BAD_PROMPTS = [None, 3.5, {"text": "hi"}, {"prompt": "a", "prompt_token_ids": [1]}, {"prompt": [1, 2]},
               {"prompt_token_ids": "12"}, [1, 2.0, 3], [1, None], [True, 2], [[1, 2], 3.0], {}]


@pytest.mark.parametrize("bad", BAD_PROMPTS, ids=[repr(b) for b in BAD_PROMPTS])
def test_bad_prompts_are_refused_saying_which(qwen3, bad):
    llm = LLM(qwen3[0], tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="prompt 1: "):
        llm.generate(["fine", bad], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # "fine" was taken back
    with pytest.raises(ValueError):
        llm.generate(bad, SamplingParams(max_tokens=2), use_tqdm=False)


def test_bad_requests_are_refused_by_the_engine(qwen3):
    engine = LLMEngine(qwen3[0], max_num_seqs=8)
    vocab = qwen3[0].config.vocab_size
    for params in (SamplingParams(stop_token_ids=[vocab]), SamplingParams(logprobs=vocab + 1),
                   SamplingParams(prompt_logprobs=vocab + 1), SamplingParams(stop="x"),  # no tokenizer
                   SamplingParams(n=9)):
        with pytest.raises(ValueError):
            engine.add_request(prompt=PROMPT, params=params)
    for request_id in ("auto-3", "", 7, b"id", ["x"]):
        with pytest.raises(ValueError, match="request_id"):
            engine.add_request(prompt=PROMPT, params=SamplingParams(), request_id=request_id)
    with pytest.raises(ValueError):
        engine.add_request(prompt=PROMPT, params={"max_tokens": 3})
    with pytest.raises(ValueError, match="SamplingParams"):
        LLM(qwen3[0]).generate([PROMPT], ["greedy"], use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_automatic_request_ids_never_collide_with_chosen_ones(qwen3):
    engine = LLMEngine(qwen3[0])
    chosen = [engine.add_request(prompt=PROMPT, request_id=str(i)) for i in range(3)]
    automatic = [engine.add_request(prompt=PROMPT) for _ in range(3)]
    assert chosen == ["0", "1", "2"] and len(set(automatic) | set(chosen)) == 6
    assert all(i.startswith("auto-") for i in automatic)
    with pytest.raises(ValueError, match="in use"):
        engine.add_request(prompt=PROMPT, request_id="1")
    llm = LLM(qwen3[0])
    llm.engine.add_request(prompt=PROMPT, params=SamplingParams(max_tokens=2), request_id="0")  # LLM's own first id
    outs = llm.generate([PROMPT, PROMPTS[0]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.request_id for o in outs] == ["1", "2"] and [len(o.outputs[0].token_ids) for o in outs] == [3, 3]


def test_chat_renders_the_template_and_refuses_tokenizers_without_one(default_model):
    model, tokenizer = default_model
    llm = LLM(model, tokenizer=tokenizer, num_kv_blocks=64)
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "def add(a, b):"}]
    with pytest.raises(ValueError, match="chat template"):
        llm.chat(messages)
    template = ("{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}# answer:\n{% endif %}")
    params = SamplingParams(max_tokens=6, temperature=0)
    out = llm.chat(messages, params, use_tqdm=False, chat_template=template)[0]
    rendered = "# system: Write Python.\n# user: def add(a, b):\n# answer:\n"
    assert out.prompt == rendered and out.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert out.outputs[0].token_ids == llm.generate(rendered, params, use_tqdm=False)[0].outputs[0].token_ids
    both = llm.chat([messages, messages[1:]], params, use_tqdm=False, chat_template=template)
    assert both[0].outputs[0].token_ids == out.outputs[0].token_ids and both[1].prompt.startswith("# user")
    for bad in ([{"role": "user"}], [{"role": 1, "content": "x"}], "hello", [[]]):
        with pytest.raises(ValueError):
            llm.chat(bad, params, chat_template=template)


def test_max_tokens_none_runs_to_the_context_and_final_only_reports_once(qwen3):
    llm = LLM(qwen3[0], max_model_len=32)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=None, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (32 - len(PROMPT), "length")
    engine = LLMEngine(qwen3[0])
    engine.add_request(prompt=PROMPT, params=SamplingParams(max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY), request_id="f")
    engine.add_request(prompt=PROMPT, params=SamplingParams(max_tokens=5), request_id="c")
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.request_id for o in engine.step()]
    assert seen.count("f") == 1 and seen.count("c") == 5
