"""Issue 49: vLLM's `logprob_token_ids`: at every generated position the answer reports the
chosen token's logprob and those of the listed token ids, whatever their rank, in place of the
top-k alternatives (vLLM's order: the chosen token first, then the listed ones; a listed id that
is the chosen token appears once). The logprobs equal transformers' log_softmax of its own logits
at each position (fp32 tolerance), through the official openai client (extra_body), on both
routes, streamed or not; the offline SamplingParams and the sampler's gathering are checked
against plain PyTorch. Bad values are a 400 that names the field."""
from __future__ import annotations

import httpx
import pytest
import torch
from server_checks import MODEL, TIMEOUT, openai_client, running_server
from transformers import AutoModelForCausalLM

from minivllm import DEFAULT_MODEL, LLM, LLMEngine, SamplingParams
from minivllm.request.logprobs import LOWEST_LOGPROB, report_logprobs

pytestmark = [pytest.mark.ch10, pytest.mark.floors]

ENGINE = {"num_kv_blocks": 256, "max_num_seqs": 16}
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Add two numbers."}]
LISTED = [7, 300, 1234, 4095]
TOLERANCE = 1e-4  # fp32 logits against transformers' fp32 logits, both log_softmaxed in float64


# ---- the pieces, against plain PyTorch ----

def test_sampling_params_validate_and_ask_for_logprobs():
    params = SamplingParams(logprob_token_ids=[3, 5])
    assert params.logprob_token_ids == (3, 5) and params.logprobs == 0  # asking for ids asks for logprobs
    assert params.logprob_columns == (3, 5)
    assert SamplingParams(logprobs=2).logprob_columns == 2
    assert SamplingParams(logprobs=4, logprob_token_ids=[1]).logprob_columns == (1,)  # the list replaces top-k
    assert len(SamplingParams(logprob_token_ids=list(range(128))).logprob_token_ids) == 128  # vLLM's bound
    for bad, words in (([], "empty"), ([1, -2], "-2"), ([1.0], "1.0"), ([True], "True"), ("5", "list"),
                       (list(range(129)), "128")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(logprob_token_ids=bad)
    with pytest.raises(ValueError, match=r"\[100, 120\] in logprob_token_ids"):
        SamplingParams(logprob_token_ids=[3, 100, 120]).for_model(None, vocab_size=100)


def test_report_logprobs_gathers_listed_ids_with_true_ranks():
    torch.manual_seed(0)
    V = 50
    logits = torch.randn(4, V)
    logits[2, 7] = float("-inf")  # a masked token (a grammar's): floored, never -inf
    logprobs = logits.log_softmax(-1)
    chosen = torch.tensor([1, 2, 3, 4])
    wanted = [3, (7, 2, 40), 0, (9,)]  # a mixed batch: top-k rows and listed rows
    reports = report_logprobs(logprobs, chosen, wanted)
    reference = logits.double().log_softmax(-1)
    for r, (want, report) in enumerate(zip(wanted, reports, strict=True)):
        expected = [int(chosen[r])] + (list(want) if isinstance(want, tuple) else reference[r].topk(want).indices.tolist())
        assert report.token_ids == expected
        for t, lp, rank in zip(report.token_ids, report.logprobs, report.ranks, strict=True):
            assert lp == pytest.approx(max(reference[r, t].item(), LOWEST_LOGPROB), abs=1e-5)
            assert rank == int((reference[r] > reference[r, t]).sum()) + 1


# ---- through the server, against transformers ----

@pytest.fixture(scope="module")
def client(default_model, chat_tokenizer):
    # --max-logprobs caps top_logprobs, not the listed ids (vLLM's: those have a bound of their own, 128)
    with running_server(LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE), max_logprobs=2) as (url, _):
        yield url, openai_client(url)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def reference_logprobs(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), V]: transformers' log_softmax (float64) at every generated position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids])).logits[0].double()
    return logits[len(prompt_ids) - 1:-1].log_softmax(-1)


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name.removeprefix("token_id:"))


def check_positions(hf_model, prompt_ids, output_ids, positions, listed):
    """positions: per generated token, (its logprob, [(id, logprob) as the answer lists them])."""
    reference = reference_logprobs(hf_model, prompt_ids, output_ids)
    assert len(positions) == len(output_ids)
    for i, (token, (logprob, shown)) in enumerate(zip(output_ids, positions, strict=True)):
        assert logprob == pytest.approx(reference[i, token].item(), abs=TOLERANCE)
        assert [t for t, _ in shown] == [token] + [t for t in listed if t != token]  # vLLM's order
        for t, lp in shown:
            assert lp == pytest.approx(reference[i, t].item(), abs=TOLERANCE)


FIELDS = {"logprob_token_ids": LISTED, "return_token_ids": True, "return_tokens_as_token_ids": True}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 3, "top_k": 5}],
                         ids=["greedy", "sampled"])
def test_chat_reports_the_listed_ids_at_every_position(client, hf_model, sampling):
    _, api = client
    answer = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2,
                                         extra_body=FIELDS | sampling)
    choice = answer.choices[0]
    first = choice.token_ids[0]
    listed = LISTED + [first]  # the first chosen token listed too: it appears once, first
    answer = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2,
                                         extra_body=FIELDS | sampling | {"logprob_token_ids": listed})
    choice = answer.choices[0]
    positions = [(c.logprob, [(token_id(a.token), a.logprob) for a in c.top_logprobs]) for c in choice.logprobs.content]
    assert [token_id(c.token) for c in choice.logprobs.content] == choice.token_ids
    check_positions(hf_model, answer.prompt_token_ids, choice.token_ids, positions, listed)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_report_the_listed_ids_at_every_position(client, hf_model, stream):
    _, api = client
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0, "extra_body": FIELDS}
    if stream:
        tokens, logprobs, tops, prompt_ids = [], [], [], None
        for chunk in api.completions.create(stream=True, **kwargs):
            prompt_ids = prompt_ids or chunk.choices[0].prompt_token_ids
            if chunk.choices[0].logprobs is not None:
                tokens += chunk.choices[0].logprobs.tokens
                logprobs += chunk.choices[0].logprobs.token_logprobs
                tops += chunk.choices[0].logprobs.top_logprobs
    else:
        choice = api.completions.create(**kwargs).choices[0]
        prompt_ids = choice.prompt_token_ids
        tokens, logprobs, tops = choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
    output_ids = [token_id(t) for t in tokens]
    positions = [(lp, [(token_id(t), a) for t, a in top.items()]) for lp, top in zip(logprobs, tops, strict=True)]
    check_positions(hf_model, prompt_ids, output_ids, positions, LISTED)


@pytest.mark.parametrize("speculative_config", [
    pytest.param(None, id="plain"),
    pytest.param({"method": "ngram", "num_speculative_tokens": 3}, id="speculative", marks=pytest.mark.ch12)])
def test_offline_llm_reports_them_in_a_mixed_batch(default_model, chat_tokenizer, hf_model, speculative_config):
    """Two requests in one batch, one asking for the top 2, one for listed ids: each gets its own
    (under speculative decoding too, where the verifier reports the accepted tokens' logprobs)."""
    llm = LLM(default_model, tokenizer=chat_tokenizer, speculative_config=speculative_config, **ENGINE)
    prompt_ids = chat_tokenizer.encode(PROMPT * 3)  # repeats: ngram speculation finds drafts
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * 2,
                        [SamplingParams(temperature=0, max_tokens=8, logprobs=2),
                         SamplingParams(temperature=0, max_tokens=8, logprob_token_ids=LISTED)], use_tqdm=False)
    top, listed = outs[0].outputs[0], outs[1].outputs[0]
    assert top.token_ids == listed.token_ids
    reference = reference_logprobs(hf_model, prompt_ids, listed.token_ids)
    for i, (token, entry) in enumerate(zip(listed.token_ids, listed.logprobs, strict=True)):
        assert list(entry) == [token] + [t for t in LISTED if t != token]
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(reference[i, t].item(), abs=TOLERANCE)
        assert set(top.logprobs[i]) == {token, *reference[i].topk(2).indices.tolist()}


def test_bad_values_are_a_400_that_names_them(client):
    url, _ = client
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", chat | {"logprob_token_ids": [5]}, "logprobs"),  # logprobs not asked for
        ("/v1/chat/completions", chat | {"logprobs": True, "logprob_token_ids": []}, "empty"),
        ("/v1/chat/completions", chat | {"logprobs": True, "logprob_token_ids": [5, "x"]}, "logprob_token_ids"),
        ("/v1/chat/completions", chat | {"logprobs": True, "logprob_token_ids": [5, 10**7]}, "10000000"),
        ("/v1/chat/completions", chat | {"logprobs": True, "logprob_token_ids": list(range(129))}, "128"),
        ("/v1/completions", completion | {"logprob_token_ids": [5]}, "logprobs"),
        ("/v1/completions", completion | {"logprobs": 1, "logprob_token_ids": [5], "echo": True, "max_tokens": 0},
         "max_tokens=0"),
    ]
    with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        for path, body, words in cases:
            response = http.post(path, json=body)
            assert response.status_code == 400, (body, response.text)
            assert "logprob_token_ids" in response.text and words in response.text, response.text


def test_a_core_process_reports_what_the_engine_thread_reports(client, default_model, chat_tokenizer):
    """Chapter 15: the listed ids cross to a core process with the rest of the params."""
    kwargs = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0, "extra_body": FIELDS}
    threaded_answer = client[1].completions.create(**kwargs).choices[0].logprobs
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    with running_server(engine, core_process=True) as (url, _):
        answer = openai_client(url).completions.create(**kwargs).choices[0].logprobs
    assert answer.tokens == threaded_answer.tokens
    for got, want in zip(answer.top_logprobs, threaded_answer.top_logprobs, strict=True):
        assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_the_gpu_engine_reports_the_cpu_engines_listed_logprobs(speculative_config):
    """The GPU's default engine (async scheduling, graphs, Triton) in fp32 gathers the same
    listed ids, in the same order, with the CPU engine's logprobs, with and without speculation."""
    params = SamplingParams(temperature=0, max_tokens=16, logprob_token_ids=LISTED)
    prompt = "def add(a, b):\n    return a + b\n" * 3
    cpu = LLM(device="cpu", **ENGINE).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    gpu = LLM(device="cuda", dtype=torch.float32, speculative_config=speculative_config,
              **ENGINE).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert gpu.token_ids == cpu.token_ids
    for on_gpu, on_cpu in zip(gpu.logprobs, cpu.logprobs, strict=True):
        assert list(on_gpu) == list(on_cpu)
        for token, entry in on_gpu.items():
            assert abs(entry.logprob - on_cpu[token].logprob) < 1e-3
