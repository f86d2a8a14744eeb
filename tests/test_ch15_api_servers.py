"""Issue 48: `minivllm serve --api-server-count N`, N API server processes on one port in front of
one engine core process.

What a user must not be able to tell: the streams equal the offline engine's greedy tokens
whichever API server answers (both must answer some), and /metrics counts every request, whichever
API server it went to and whichever one /metrics asks. What a user must be able to rely on, as
chapter 15 promised for one process: SIGTERM ends everything with exit 0; an API server or the core
killed makes every stream end in an error, the command exit non-zero, and no process outlive it.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import uvicorn
from server_checks import ENGINE, TIMEOUT, metric_values, openai_client
from test_ch15_core_process import GREEDY, PROMPTS, free_port, gone, offline

from minivllm import LLM, LLMEngine, SamplingParams
from minivllm.core.process import MAX_LEAD, Senders, run_core
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.metrics import MULTIPROCESS_FOLDER
from minivllm.engine.process_client import CoreAddresses, RunningCores
from minivllm.entrypoints.cli import build_parser
from minivllm.entrypoints.openai.app import build_app
from minivllm.request.messages import (
    Abort,
    AddRequest,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreStats,
    Refused,
    from_core_decoder,
)

pytestmark = [pytest.mark.ch15, pytest.mark.floors]
NAME = "minivllm-default"
HEADER = "x-minivllm-api-server"


@pytest.fixture(scope="module")
def llm(default_model, chat_tokenizer) -> LLM:
    return LLM(default_model, tokenizer=chat_tokenizer, **ENGINE)


class Served:
    """`minivllm serve --api-server-count N` in its own process (the offline engine's settings),
    and every process it started."""

    def __init__(self, count: int, *args: str):
        port = free_port()
        command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--port", str(port), "--threads", "1",
                   "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
                   "--no-persistent-batch", "--api-server-count", str(count), *args]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert self.process.poll() is None, f"the server exited: {self.process.stderr.read()}"
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            try:
                if httpx.get(f"{self.url}/health", trust_env=False, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        self.children = psutil.Process(self.process.pid).children(recursive=True)
        self.api_servers = self.find_api_servers(count)
        self.core = httpx.get(f"{self.url}/server_info", trust_env=False).json()["core_pid"]
        # its folder (sockets, metrics): the parent of the metrics folder it gave the API servers
        self.folder = Path(psutil.Process(self.api_servers[0]).environ()[MULTIPROCESS_FOLDER]).parent
        assert self.folder.name.startswith("minivllm-serve-") and self.folder.is_dir(), self.folder

    def find_api_servers(self, count: int) -> dict[int, int]:
        """index -> pid of every API server, from /server_info (each new connection goes to one of them)."""
        found: dict[int, int] = {}
        for _ in range(200):
            with httpx.Client(trust_env=False, timeout=TIMEOUT) as http:  # a new connection each time
                info = http.get(f"{self.url}/server_info").json()
            found[info["api_server_index"]] = info["api_server_pid"]
            if len(found) == count:
                return found
            time.sleep(0.01)
        raise AssertionError(f"only API servers {sorted(found)} of {count} ever answered")

    def assert_nothing_left(self, seconds: float = 10) -> None:
        """No process it started still runs, and its folder (sockets, metrics) is gone."""
        deadline = time.monotonic() + seconds
        while ([p for p in self.children if not gone(p.pid)] or self.folder.exists()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [" ".join(p.cmdline()) for p in self.children if not gone(p.pid)]
        assert not left, f"processes left behind: {left}"
        assert not self.folder.exists(), f"{self.folder} left behind"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for p in self.children:
            if not gone(p.pid):
                p.kill()


@pytest.fixture()
def two_api_servers() -> Iterator[Served]:
    served = Served(2)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(params=["one core", "two data-parallel cores"])
def two_api_servers_in_front_of(request) -> Iterator[Served]:
    served = Served(2, *(["--data-parallel-size", "2"] if request.param == "two data-parallel cores" else []))
    try:
        yield served
    finally:
        served.stop()


def test_bad_api_server_counts_are_refused_with_a_clear_error(capsys):
    for bad, why in (("0", "at least 1"), ("-2", "at least 1"), ("two", "whole number"), ("1.5", "whole number")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--api-server-count", bad])
        assert why in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--api-server-count", "3"]).api_server_count == 3
    with pytest.raises(SystemExit, match="--api-server-count > 1 needs the engine core in processes"):
        serve("--api-server-count", "2", "--engine-core", "thread")
    with socket.socket() as taken:  # a port in use: said at once, before any process starts
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit, match="already in use"):
            serve("--api-server-count", "2", "--port", str(taken.getsockname()[1]))
    assert MULTIPROCESS_FOLDER not in os.environ


def serve(*args: str) -> None:
    """`minivllm serve ARGS` in this process (without main()'s process-wide settings)."""
    args = build_parser().parse_args(["serve", *args])
    args.run(args)


class FakeCore:
    """A stand-in EngineCore: holds requests by id (refusing one in use, as the core does)."""

    def __init__(self) -> None:
        self.requests: dict[str, EngineCoreRequest] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def abort_sequences(self, sequences: list[tuple[str, int]]) -> None:
        self.abort_requests([request_id for request_id, _ in sequences])

    def stats(self) -> EngineCoreStats:
        return EngineCoreStats(len(self.requests), 0, 0.5, 100, 40, num_preemptions=3, waiting_deferred=1)


class SentMessages:
    """A stand-in PUSH socket: what the core sent to one API server, decoded."""

    def __init__(self) -> None:
        self.messages: list = []

    def send(self, data: bytes) -> None:
        self.messages.append(from_core_decoder.decode(data))


def test_the_core_sends_each_api_server_its_own_requests_and_takes_its_aborts_only():
    core, sockets = FakeCore(), [SentMessages(), SentMessages()]
    senders = Senders(sockets)
    params = SamplingParams(max_tokens=4)
    assert senders.apply(core, 0, AddRequest(EngineCoreRequest("a", [1, 2], params, 0.0))) is None
    assert senders.apply(core, 1, AddRequest(EngineCoreRequest("b", [3], params, 0.0))) is None
    taken = senders.apply(core, 1, AddRequest(EngineCoreRequest("a", [4], params, 0.0)))  # the same id, elsewhere
    assert isinstance(taken, Refused) and taken.bad_request
    senders.apply(core, 1, Abort(["a"]))  # not API server 1's request: ignored
    assert set(core.requests) == {"a", "b"}
    del core.requests["b"]  # b finishes in this step
    senders.step_outputs(core, [EngineCoreOutput("a", 0, [5]), EngineCoreOutput("b", 0, [6], finish_reason="length")],
                         1.0, 2.0)
    first, second = sockets[0].messages[-1], sockets[1].messages[-1]
    assert [o.request_id for o in first.outputs] == ["a"] and [o.request_id for o in second.outputs] == ["b"]
    assert first.stats == core.stats()  # the running sums: API server 0 only, so /metrics counts them once
    assert (second.stats.running, second.stats.kv_cache_usage) == (1, 0.5)
    assert (second.stats.prefix_queried_tokens, second.stats.prefix_hit_tokens, second.stats.spec,
            second.stats.num_preemptions, second.stats.waiting_deferred) == (0, 0, None, 0, 1)
    assert senders.owner == {"a": 0}  # b is forgotten once it is gone from the core
    senders.apply(core, 0, Abort(["a"]))
    assert not core.requests and not senders.owner


def test_the_core_runs_at_most_max_lead_steps_ahead_of_the_slowest_api_server():
    senders = Senders([SentMessages(), SentMessages()])
    assert senders.may_step()  # neither paces it (yet): it runs free
    senders.sent, senders.taken = 5, [5, None]
    assert senders.may_step()
    senders.taken = [5, 5 - MAX_LEAD]  # the second has fallen MAX_LEAD steps behind
    assert not senders.may_step()
    senders.taken = [5 - MAX_LEAD + 1, 4]
    assert senders.may_step()


@contextmanager
def serving(app) -> Iterator[str]:
    """`app` served by uvicorn in a thread of this process, on 127.0.0.1; yields its url."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.mark.slow
def test_a_dead_core_fails_the_streams_of_every_api_server_and_their_health(default_model, chat_tokenizer, tmp_path):
    """Two API servers (here: two apps in this process, which stay up after the core dies, so that
    /health can be asked at leisure) attached to one core process that they did not start."""
    config = LLMEngine(default_model, tokenizer=chat_tokenizer, **ENGINE).config
    pairs = [(f"ipc://{tmp_path}/in{i}", f"ipc://{tmp_path}/out{i}") for i in range(2)]
    core = multiprocessing.get_context("spawn").Process(
        target=run_core, args=(default_model, config, chat_tokenizer, [p[0] for p in pairs], [p[1] for p in pairs]),
        kwargs={"threads": 1}, daemon=True)
    core.start()
    try:
        apps = [build_app(AsyncLLM(RunningCores([CoreAddresses(core.pid, *pairs[i])], i, 2), config, chat_tokenizer),
                          NAME) for i in range(2)]
        with serving(apps[0]) as first, serving(apps[1]) as second:
            threads, ended, started = [], {}, []
            for url in (first, second):
                t, e, s = streams_until_they_end(url, 2)
                threads += t
                ended[url], started = e, started + [s]
            for barrier in started:
                barrier.wait(TIMEOUT)
            killed = time.monotonic()
            os.kill(core.pid, signal.SIGKILL)
            for t in threads:
                t.join(TIMEOUT)
            assert time.monotonic() - killed < 5 + 1  # (the streams' threads end at once once their error event came)
            for url in (first, second):
                assert sorted(ended[url].values()) == ["error event", "error event"], ended
                health = httpx.get(f"{url}/health", trust_env=False, timeout=TIMEOUT)
                assert health.status_code == 503 and "exited" in health.json()["error"]["message"], health.text
    finally:
        core.kill()
        core.join()


@pytest.mark.slow
def test_two_api_servers_stream_offline_greedy_count_both_in_metrics_and_stop_on_sigterm(two_api_servers_in_front_of,
                                                                                       llm, chat_tokenizer):
    """(One server start for three checks: on this shared CPU a start takes a minute.)"""
    served = two_api_servers_in_front_of
    url = served.url
    expected = offline(llm, PROMPTS, max_tokens=12, **GREEDY)
    got: dict[int, tuple[int, list[tuple[str, list[str]]]]] = {}

    def stream(i: int) -> None:
        raw = openai_client(url).completions.with_raw_response.create(
            model=NAME, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=12, temperature=0, logprobs=0, stream=True,
            extra_body={"ignore_eos": True})
        chunks = [(c.choices[0].text, c.choices[0].logprobs.tokens) for c in raw.parse() if c.choices]
        got[i] = (int(raw.headers[HEADER]), chunks)

    requests = 0
    while requests < 48 and len({server for server, _ in got.values()}) < 2:  # until both API servers answered
        threads = [threading.Thread(target=stream, args=(requests + k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        requests += 8
    assert len(got) == requests, "a stream failed"
    assert {server for server, _ in got.values()} == {0, 1}, "one API server answered every request"
    for i, (_, chunks) in got.items():
        completion = expected[i % len(PROMPTS)]
        assert "".join(text for text, _ in chunks) == completion.text
        assert [t for _, tokens in chunks for t in tokens] == [chat_tokenizer.decode([t]) for t in completion.token_ids]
    views = {}
    while len(views) < 2:  # /metrics from each API server: one and the same view of both
        with httpx.Client(base_url=url, trust_env=False, timeout=TIMEOUT) as http:
            response = http.get("/server_info")
            views[response.headers[HEADER]] = metric_values(http)
    for values in views.values():
        assert values["minivllm_requests_finished_total{finished_reason=length}"] == requests
        assert values["minivllm_generation_tokens_total"] == 12 * requests
        assert values["minivllm_num_requests_running"] == 0
        assert values[f"vllm:request_success_total{{finished_reason=length,model_name={NAME}}}"] == requests
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(30) == 0, served.process.stderr.read()
    served.assert_nothing_left()


def streams_until_they_end(url: str, count: int) -> tuple[list[threading.Thread], dict[int, str], threading.Barrier]:
    """`count` streams of 400 tokens, each on its own connection; each records how it ended:
    "error event", "cut" (the connection broke) or "finished" (it must not)."""
    ended: dict[int, str] = {}
    started = threading.Barrier(count + 1)

    def stream(i: int) -> None:
        body = {"model": NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT, trust_env=False) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                started.wait(TIMEOUT)
                ended[i] = "finished"
                for line in lines:
                    if line.startswith('data: {"error"'):
                        ended[i] = "error event"
        except httpx.HTTPError:
            ended[i] = "cut"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads, ended, started


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["api server 1", "core", "minivllm serve"])
def test_a_killed_api_server_core_or_parent_ends_every_stream_and_the_command(two_api_servers, victim):
    served = two_api_servers
    threads, ended, started = streams_until_they_end(served.url, 6)
    started.wait(TIMEOUT)
    health: list[int] = []
    pids = {"api server 1": served.api_servers[1], "core": served.core, "minivllm serve": served.process.pid}
    os.kill(pids[victim], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and served.process.poll() is None:  # /health never says 200 again
        try:
            health.append(httpx.get(f"{served.url}/health", trust_env=False, timeout=1).status_code)
        except httpx.HTTPError:
            pass
    for t in threads:
        t.join(TIMEOUT)
    assert sorted(ended) == list(range(6)) and "finished" not in ended.values(), ended
    if victim == "core":  # the streams of both API servers saw the core die: each got its error event
        assert set(ended.values()) == {"error event"}, ended
    if 503 in health:  # once /health says the engine is gone, it never says 200 again
        assert 200 not in health[health.index(503):], health
    if victim == "core":  # the core's pid is watched: /health says 503 at once (the first may predate the kill)
        assert 200 not in health[1:], health
    assert served.process.wait(30) != 0
    if victim != "minivllm serve":
        assert ("engine core process" if victim == "core" else "API server process") in served.process.stderr.read()
    served.assert_nothing_left()


def test_sigterm_while_the_api_servers_still_load_is_a_clean_stop(tmp_path):
    """A stop asked for before the API servers are up (here: as soon as they exist, still importing)
    ends them as asked: exit 0, no socket file, nothing left running. (Before the fix, each API
    server ended by the SIGTERM itself, exit code -15, and the command reported them as unclean.)"""
    path = tmp_path / "serve.sock"
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--uds", str(path), "--threads", "1",
               "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--no-persistent-batch", "--api-server-count", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        parent, deadline = psutil.Process(process.pid), time.monotonic() + 60
        while len([p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]) < 3:  # a core, 2 servers
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "minivllm serve started no API servers in 60 s"
            time.sleep(0.05)
        children = parent.children(recursive=True)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not path.exists()
    deadline = time.monotonic() + 10  # (the parent has waited for them: this is a margin for the kernel's bookkeeping)
    while [c for c in children if not gone(c.pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c.pid for c in children if not gone(c.pid)], "processes left behind"
