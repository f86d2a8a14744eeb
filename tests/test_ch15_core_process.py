"""Chapter 15: the engine split into an input processor, a core and an output processor, and the
core in a process of its own behind the server.

The split must change nothing a user sees: the core's per-step news, put together, are the
offline engine's tokens; the output processor's deltas add up to its cumulative outputs; a stop
string found in the text stops the core at once. The core process must serve exactly the
offline greedy tokens (through the official openai client), and fail the way users expect: one
bad request alone, everyone at once (within 5 s) when the core dies, a disconnect freeing its
request in the core, SIGTERM ending server and core cleanly, no process left behind.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from server_checks import ENGINE, MODEL, TIMEOUT, chunks_of, expect_status, openai_client, \
    running_server, wait_until_idle

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.request.messages import (Abort, AddRequest, Refused, StepOutputs, StopSequences, encoder, from_core_decoder,
                                       to_core_decoder)
from minivllm.request.messages import EngineCoreOutput, EngineCoreStats
from minivllm.request.messages import EngineCoreRequest
from minivllm.request.logprobs import TopLogprobs
from minivllm.engine.output_processor import CompletionState, new_delta
from minivllm.request.sampling_params import RequestOutputKind
from minivllm.structured_outputs import StructuredOutputsParams

pytestmark = [pytest.mark.ch15, pytest.mark.floors]
PROMPTS = ["import os\n\ndef list_files(path):\n    return", "class Stack:\n    def push(self, item):", "x = [",
           "def add(a, b):\n    "]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_model, chat_tokenizer) -> LLM:
    """The offline engine on the same weights: what every answer here must equal."""
    return LLM(default_model, tokenizer=chat_tokenizer, **ENGINE)


def offline(llm: LLM, prompts: list[str], **params) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**params), use_tqdm=False)]


# ---- the split, in one process ----

def test_the_core_sends_only_each_steps_new_tokens(default_model, chat_tokenizer, llm):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    params = SamplingParams(max_tokens=7, **GREEDY)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(request_id=str(i), prompt=prompt, params=params)
    got: dict[str, list[int]] = {}
    while engine.core.has_unfinished_requests():
        for out in engine.core.step():
            assert len(out.new_token_ids) == 1 and out.new_logprobs is None
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert (out.finish_reason == "length") == (len(got[out.request_id]) == 7)
    assert [got[str(i)] for i in range(len(PROMPTS))] == [c.token_ids for c in offline(llm, PROMPTS, max_tokens=7,
                                                                                          **GREEDY)]


def test_a_stop_string_found_in_the_text_stops_the_core_at_once(default_model, chat_tokenizer, llm):
    full = offline(llm, [PROMPTS[0]], max_tokens=30, **GREEDY)[0].text
    stop = full[8:11]
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    engine.add_request(request_id="s", prompt=PROMPTS[0], params=SamplingParams(max_tokens=30, stop=[stop], **GREEDY))
    for _ in range(40):
        outputs = engine.step()
        if outputs and outputs[0].finished:
            break
    done = outputs[0].outputs[0]
    assert (done.text, done.finish_reason, done.stop_reason) == (full[:full.find(stop)], "stop", stop)
    assert len(done.token_ids) < 30
    assert not engine.has_unfinished_requests() and "s" not in engine.core.requests
    assert engine.core.block_manager.num_free == engine.core.block_manager.num_blocks


def test_delta_outputs_add_up_to_the_cumulative_ones(default_model, chat_tokenizer):
    """The same seeded requests (n = 2, logprobs, a stop string) as DELTA and as CUMULATIVE."""
    runs = {}
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
        params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, logprobs=2, stop=["\n\n"],
                                output_kind=kind)
        engine.add_request(request_id="r", prompt=PROMPTS[1], params=params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        runs[kind] = outputs
    final = runs[RequestOutputKind.CUMULATIVE][-1]
    assert final.finished and runs[RequestOutputKind.DELTA][-1].finished
    for c in final.outputs:
        pieces = [d.outputs[c.index] for d in runs[RequestOutputKind.DELTA]]
        assert "".join(p.text for p in pieces) == c.text
        assert [t for p in pieces for t in p.token_ids] == c.token_ids
        assert [lp for p in pieces for lp in p.logprobs] == c.logprobs
        assert pieces[-1].finish_reason == c.finish_reason


def test_new_delta_sends_each_token_once():
    completion = CompletionState(0, None, token_ids=[5, 6], logprobs=None)
    first = new_delta(completion)
    assert (first.token_ids, first.text, first.finish_reason) == ([5, 6], "", None)
    assert new_delta(completion).token_ids == []
    completion.token_ids.append(9)
    completion.finish_reason = "length"
    last = new_delta(completion)
    assert (last.token_ids, last.finish_reason) == ([9], "length")


class GrowingText:
    """A stand-in for a completion's StopChecker: the text it may show now, set by the check."""

    def __init__(self) -> None:
        self.shown = ""

    def visible(self, final: bool) -> str:
        return self.shown


def test_new_delta_sends_each_character_and_logprob_once():
    """Exercise 15.1, focused: the delta's text is the visible text past sent_chars (not all of
    it, not the tokens' count of characters), its logprobs those of its own tokens; text held
    back (half a character, a possible stop string) comes with a later delta."""
    text = GrowingText()
    completion = CompletionState(0, text, logprobs=[], cumulative_logprob=0.0)
    steps = [  # (new token, its logprob entry, the visible text after it, the text this delta must carry)
        (5, {5: -0.5}, "ab", "ab"),
        (6, {6: -0.25}, "abc", "c"),
        (7, {7: -1.0}, "abc", ""),  # held back: may begin a stop string
        (8, {8: -2.0}, "abcdef", "def"),  # one token may release several characters
    ]
    for token, logprob, shown, want in steps:
        completion.token_ids.append(token)
        completion.logprobs.append(logprob)
        text.shown = shown
        sent_before = completion.sent_chars
        delta = new_delta(completion)
        assert delta.text == want, (f"after token {token}, with {shown!r} visible and {sent_before} "
                                    f"characters sent before, the delta's text must be the visible text past "
                                    f"sent_chars, {want!r}; got {delta.text!r}")
        assert delta.token_ids == [token] and delta.logprobs == [logprob], \
            f"each delta carries only its own tokens and their logprobs: got {delta.token_ids}, {delta.logprobs}"
        assert (completion.sent_tokens, completion.sent_chars) == (len(completion.token_ids), len(shown)), \
            "afterwards sent_tokens and sent_chars must cover everything the delta sent"
    again = new_delta(completion)
    assert (again.text, again.token_ids) == ("", []), "a second call right after must give nothing new"


def test_messages_cross_the_wire_unchanged():
    params = SamplingParams(max_tokens=3, stop=["x"], logprobs=1, seed=3, temperature=0.5,
                            structured_outputs=StructuredOutputsParams(regex="a+"))
    add = AddRequest(EngineCoreRequest("r", [1, 2, 3], params, 12.5))
    assert to_core_decoder.decode(encoder.encode(add)) == add
    step = StepOutputs([EngineCoreOutput("r", 1, [4], [TopLogprobs([4, 2], [-0.5, -0.25], [2, 1])], None, "stop", 4,
                                         1.5, 1, 2, 3, 1)], EngineCoreStats(1, 0, 0.25, 10, 5), 1.0, 2.0)
    assert from_core_decoder.decode(encoder.encode(step)) == step
    with pytest.raises(Exception):
        to_core_decoder.decode(encoder.encode(step))  # a message of the wrong direction is refused


def test_add_request_takes_vllms_order_and_says_so_when_called_the_old_way(default_model, chat_tokenizer):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    assert engine.add_request("a", "x = ", SamplingParams(max_tokens=2)) == "a"
    with pytest.raises(ValueError, match="vLLM's order"):
        engine.add_request("x = ", SamplingParams(max_tokens=2))


# ---- the core in its own process, behind the server ----

@pytest.fixture(scope="module")
def server(default_model, chat_tokenizer) -> Iterator[tuple[str, object]]:
    with running_server(LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE), core_process=True) as running:
        yield running


@pytest.fixture()
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server[0], timeout=TIMEOUT, trust_env=False) as client:
        yield client


def test_streams_equal_offline_greedy_token_for_token(server, llm, chat_tokenizer):
    expected = offline(llm, PROMPTS, max_tokens=24, **GREEDY)
    client = openai_client(server[0])
    got: dict[int, list] = {}

    def stream(i: int) -> None:
        chunks = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0, logprobs=0,
                                           stream=True, extra_body={"ignore_eos": True})
        got[i] = [(c.choices[0].text, c.choices[0].logprobs.tokens) for c in chunks if c.choices]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    for i, completion in enumerate(expected):
        assert "".join(text for text, _ in got[i]) == completion.text
        tokens = [token for _, tokens in got[i] for token in tokens]
        assert tokens == [chat_tokenizer.decode([t]) for t in completion.token_ids]


def test_one_request_the_core_refuses_fails_alone(server, http, llm, monkeypatch):
    """A prompt that only the core can see is bad (the frontend's check is bypassed here): that
    request gets its error, the others finish with their tokens, and the server stays healthy."""
    frontend = server[1].state.engine
    check = frontend.input_processor.process

    def poisoned(request_id, prompt, params, arrival_time=None):
        text, request = check(request_id, prompt, params, arrival_time)
        if prompt[:1] == [7]:
            request.prompt_token_ids.append(10**6)  # outside the vocabulary
        return text, request

    monkeypatch.setattr(frontend.input_processor, "process", poisoned)
    expected = offline(llm, PROMPTS[:3], max_tokens=16, **GREEDY)
    results: dict[int, httpx.Response] = {}

    def post(i: int, prompt) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        results[i] = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=TIMEOUT)

    threads = [threading.Thread(target=post, args=(i, p)) for i, p in enumerate(PROMPTS[:3] + [[7, 8, 9]])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert results[3].status_code >= 400 and "token ids" in results[3].json()["error"]["message"]
    for i, completion in enumerate(expected):
        expect_status(results[i])
        assert results[i].json()["choices"][0]["text"] == completion.text
    expect_status(http.get("/health"))


def test_a_disconnect_aborts_in_the_core_at_once(server, http):
    before = wait_until_idle(http)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        expect_status(response)
        assert len(list(chunks_of(line for _, line in zip(range(6), response.iter_lines())))) == 3
    after = wait_until_idle(http, seconds=3)  # the core's gauges say it is empty, well before 400 tokens
    assert after["minivllm_kv_cache_usage"] == 0
    assert after["minivllm_generation_tokens_total"] - before["minivllm_generation_tokens_total"] < 400
    assert after.get("minivllm_requests_finished_total{finished_reason=abort}", 0) == \
        before.get("minivllm_requests_finished_total{finished_reason=abort}", 0) + 1


def long_streams(url: str, count: int, errors: dict[int, float], started: threading.Barrier) -> list[threading.Thread]:
    """`count` streams of 400 tokens; each writes the time its error event came into `errors`."""
    def stream(i: int) -> None:
        body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            started.wait(TIMEOUT)
            for line in lines:
                if line.startswith('data: {"error"'):
                    errors[i] = time.monotonic()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def test_the_core_dying_fails_every_request_within_5_s_and_health_says_503(default_model, chat_tokenizer):
    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    with running_server(engine, core_process=True) as (url, app):
        pid = httpx.get(f"{url}/server_info").json()["core_pid"]
        errors: dict[int, float] = {}
        started = threading.Barrier(5)
        threads = long_streams(url, 4, errors, started)
        started.wait(TIMEOUT)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(TIMEOUT)
        assert sorted(errors) == [0, 1, 2, 3]
        assert max(errors.values()) - killed < 5
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "exit code -9" in health.json()["error"]["message"]
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 500


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn's SystemExit(3)
def test_a_core_that_cannot_start_fails_the_start_and_leaves_nothing_behind(default_model, chat_tokenizer,
                                                                             monkeypatch):
    import dataclasses
    import tempfile

    engine = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE)
    engine.config = dataclasses.replace(engine.config, max_model_len=10**6)  # the core process refuses it
    children, folders, mkdtemp = set(psutil.Process().children(recursive=True)), [], tempfile.mkdtemp

    def recorded_mkdtemp(*args, **kwargs):  # the core's socket folders this test makes, and no other program's
        folder = mkdtemp(*args, **kwargs)
        if "minivllm-core-" in folder:
            folders.append(folder)
        return folder

    monkeypatch.setattr(tempfile, "mkdtemp", recorded_mkdtemp)
    with pytest.raises(RuntimeError, match="did not start"):
        with running_server(engine, core_process=True):
            pass
    deadline = time.monotonic() + 10  # a child of the failed start may take a moment to exit
    while True:
        left = [p for p in set(psutil.Process().children(recursive=True)) - children
                if not gone(p.pid) and "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's, for life
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, [" ".join(p.cmdline()) for p in left]
    assert folders, "the start made no folder for its sockets: the check proves nothing"
    assert not [f for f in folders if os.path.exists(f)], folders


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def started_cli_server(*args: str) -> tuple[subprocess.Popen, str, int]:
    """`minivllm serve` (the embedded model) in its own process; (process, url, its core's pid). The
    server is chapter 15's: its core runs without chapter 16's persistent batch (a process of its own
    does not see tests/conftest.py's LATER_DEFAULTS)."""
    port = free_port()
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port", str(port), "--threads", "1",
               "--num-kv-blocks", "64", "--max-num-seqs", "8", "--no-persistent-batch", *args]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        assert server.poll() is None, f"the server exited: {server.stderr.read()}"
        assert time.monotonic() < deadline, "the server did not start in 120 s"
        try:
            if httpx.get(f"{url}/health", trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    return server, url, httpx.get(f"{url}/server_info", trust_env=False).json()["core_pid"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigterm_ends_the_server_and_its_core_cleanly():
    server, url, core = started_cli_server()
    try:
        expect_status(httpx.post(f"{url}/v1/completions", json={"model": "minivllm-default", "prompt": "x = ",
                                                                 "max_tokens": 3}, timeout=TIMEOUT))
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        assert gone(core)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_dead_core_ends_the_cli_server_with_a_nonzero_exit():
    server, url, core = started_cli_server()
    try:
        os.kill(core, signal.SIGKILL)
        assert server.wait(30) != 0
        assert "engine core" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# ---- the measurement's pieces (the measurement itself is chapters/15_engine_core_process.py) ----

def test_the_cheap_model_is_the_named_shape_with_the_embedded_tokenizer(tmp_path, chat_tokenizer):
    from minivllm.course.bench.split_serving import CHEAP_SHAPE, offline_run, write_cheap_model
    from minivllm.loader import load_model, load_tokenizer

    folder = write_cheap_model(tmp_path)
    model, tokenizer = load_model(str(folder), device="cpu"), load_tokenizer(str(folder))
    assert (model.config.num_layers, model.config.hidden_size) == (CHEAP_SHAPE["num_hidden_layers"],
                                                                   CHEAP_SHAPE["hidden_size"])
    assert tokenizer.encode("def f(x):") == chat_tokenizer.encode("def f(x):")
    run = offline_run(folder, users=1)
    assert run["requests"] == 32 and run["output_tokens"] > run["requests"] and run["seconds"] > 0


class RecordingCore:
    """A stand-in EngineCore for exercise 15.2: records what it is asked; refuses requests by id."""

    def __init__(self, refusals: dict[str, Exception]):
        self.refusals, self.calls = refusals, []

    def add_request(self, request):
        if request.request_id in self.refusals:
            raise self.refusals[request.request_id]
        self.calls.append(("add", request.request_id))

    def abort_requests(self, request_ids):
        self.calls.append(("abort", list(request_ids)))

    def abort_sequences(self, sequences):
        self.calls.append(("stop", [tuple(s) for s in sequences]))


def test_apply_message_adds_aborts_stops_and_refuses_a_request_alone():
    """The core loop's step between two steps: each message reaches the core as its own call; a request the core
    cannot take comes back as Refused, a 400 for a ValueError and a 500 for anything else, and
    the loop (and every other request) carries on."""
    from minivllm.core.process import apply_message

    core = RecordingCore({"bad": ValueError("prompt too long"), "broken": RuntimeError("out of memory")})
    params = SamplingParams(max_tokens=2)
    replies = [apply_message(core, message) for message in (
        AddRequest(EngineCoreRequest("ok", [1, 2], params, 0.0)),
        AddRequest(EngineCoreRequest("bad", [1, 2], params, 0.0)),
        AddRequest(EngineCoreRequest("broken", [1, 2], params, 0.0)),
        Abort(["x", "y"]),
        StopSequences([("ok", 0)]),
    )]
    assert core.calls == [("add", "ok"), ("abort", ["x", "y"]), ("stop", [("ok", 0)])], (
        "AddRequest -> core.add_request, Abort -> core.abort_requests(its ids), StopSequences -> "
        f"core.abort_sequences(its sequences), each once and in order; the core was asked: {core.calls}")
    assert replies[0] is None and replies[3:] == [None, None], f"only a refused request gets a reply: {replies}"
    bad, broken = replies[1], replies[2]
    assert isinstance(bad, Refused) and (bad.request_id, bad.bad_request) == ("bad", True), (
        f"a ValueError is the request's own fault: Refused('bad', ..., bad_request=True), got {bad!r}")
    assert bad.message == "ValueError: prompt too long", f"the message names the error's type and text: {bad.message!r}"
    assert isinstance(broken, Refused) and (broken.request_id, broken.bad_request) == ("broken", False), (
        f"any other error is the core's failure on this request: Refused('broken', ..., bad_request=False), "
        f"got {broken!r}")
