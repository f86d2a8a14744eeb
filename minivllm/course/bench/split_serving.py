"""Chapter 15's measurement: chapter 10's one-process server against the server whose engine
core runs in a process of its own, on the same requests, and both against the engine offline.

Why a cheap model: with the embedded model a CPU step takes ~50 ms, and any server keeps up
with that. A GPU runs a 0.6B model's batch-128 step in milliseconds, where the server's own
Python (HTTP, detokenizing, JSON, one event per token) is what users wait for. A random
2-layer, 64-wide Qwen3-shaped model with the embedded tokenizer puts a CPU in that regime, and
short prompts (the "chat" workload) keep each step mostly the host's work.

How it is measured, so that the numbers mean what they say:
- both servers are `minivllm serve` processes (`--engine-core thread`, chapter 10, and
  `--engine-core process`, chapter 15), with one torch thread each, started side by side;
- the load generator is `minivllm bench-serve` in a process of its own (never inside a server),
  closed loop, at least 4 requests per user, each level run on both servers before the next;
- the offline rate is `LLM.generate` on exactly the 128-user level's requests, in the same run
  (the servers stopped by then), with the same engine settings: the served token rate at 128
  streams divided by it is the server's efficiency; ITL p50 is compared with the offline step.
The machine's load average is written beside every level (a shared machine drifts).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from minivllm.course.bench.harness import RESULTS_DIR, save_results
from minivllm.course.bench.load import clip_to_context
from minivllm.course.bench.workloads import make_workload

# A Qwen3 shape whose batch-128 decode step is a few milliseconds of one CPU thread.
CHEAP_SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
WORKLOAD = "chat"
USERS = (1, 8, 32, 128)
ENGINE = dict(max_num_seqs=128, num_kv_blocks=4096)  # every server and the offline run: 128 at once, room for all
SERVERS = {"one process (ch10)": "thread", "core process (ch15)": "process"}
START_TIMEOUT = 180.0  # seconds a server may take to start on a loaded machine


def write_cheap_model(folder: Path, seed: int = 0) -> Path:
    """A checkpoint folder: CHEAP_SHAPE with random weights (seeded) and the embedded model's
    tokenizer and vocabulary, so that the servers detokenize real text."""
    import transformers

    from minivllm.loader import DEFAULT_MODEL

    vocab = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["vocab_size"]
    config = transformers.Qwen3Config(vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0, **CHEAP_SHAPE)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL) / name, folder / name)
    return folder


def offline_run(model: Path, users: int, seed: int = 0, threads: int = 1) -> dict[str, Any]:
    """LLM.generate on the requests of the `users`-user level (4 per user, as bench-serve sends
    them): output tokens per second, and the median step time with at least 90 % of `users`
    in the batch."""
    from minivllm.core.trace import Trace
    from minivllm.entrypoints.llm import LLM
    from minivllm.request.sampling_params import SamplingParams

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(str(model), **ENGINE)
        work = clip_to_context(make_workload(WORKLOAD, llm.engine.model.config.vocab_size, seed=seed,
                                             num_requests=max(32, 4 * users)), llm.engine.max_model_len)
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
        prompts = [{"prompt_token_ids": p} for p in work.prompts]
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # first-call costs, as bench-serve's warm-up
        llm.trace = Trace()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    full = sorted(s.seconds for s in llm.trace.steps if len(s.decode) + len(s.prefill) >= 0.9 * users)
    return {"requests": len(prompts), "output_tokens": sum(work.output_lens), "seconds": seconds,
            "output_throughput": sum(work.output_lens) / seconds, "steps": len(llm.trace.steps),
            "step_seconds_p50_full_batch": full[len(full) // 2] if full else None, "threads": threads}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(servers: list[tuple[str, list[str], str]]) -> Iterator[None]:
    """Processes of ours that serve on 127.0.0.1, each (name, `minivllm` arguments, a url that
    answers GET with 200 once it is up), started all at once (a server takes seconds to start on a
    loaded machine), each given START_TIMEOUT s from when the previous one was up. Yields once
    every one is up; stops them all on the way out (`stop`). Their stderr goes
    to a temporary file, quoted if one exits early."""
    with ExitStack() as stack:
        started = []
        for name, arguments, ready in servers:
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            process = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", *arguments],
                                       stdout=subprocess.DEVNULL, stderr=log, text=True)
            stack.callback(stop, process)
            started.append((name, process, ready, log))
        for name, process, ready, log in started:  # each may take START_TIMEOUT more: they start side by side
            wait_until_up(name, process, ready, lambda log=log: log.seek(0) or log.read())
        yield


def wait_until_up(name: str, process: subprocess.Popen, ready: str, output: Callable[[], str]) -> None:
    """Return once `ready` answers GET with 200; a RuntimeError if `process` (the server called
    `name`) exits first, quoting the end of `output()`, or if START_TIMEOUT s pass."""
    deadline = time.monotonic() + START_TIMEOUT
    while not answers(ready):
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited: {output()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start within {START_TIMEOUT:g} s")
        time.sleep(0.2)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def stop(process: subprocess.Popen) -> None:
    """SIGTERM, then kill if it still runs after 60 s (a server with several API servers stops its
    children one group at a time, up to 15 s each)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def cli_server(model: Path, engine_core: str, threads: int = 1) -> Iterator[str]:
    """`minivllm serve` in its own process on 127.0.0.1; yields its url, then stops it (`running`)."""
    port = free_port()
    command = ["serve", "--model", str(model), "--port", str(port), "--threads", str(threads), "--engine-core",
               engine_core, "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--num-kv-blocks", str(ENGINE["num_kv_blocks"]),
               "--max-waiting", "4096"]
    url = f"http://127.0.0.1:{port}"
    with running([(f"the {engine_core} server", command, f"{url}/health")]):
        yield url


def load_generator(urls: Sequence[str], labels: Sequence[str], users: Sequence[int], results: str, figure: str,
                   seed: int = 0, timeout: float = 600.0) -> None:
    """`minivllm bench-serve` in a process of its own, every level on every server in turn."""
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "bench-serve", "--url", ",".join(urls),
               "--label", ",".join(labels), "--concurrency", ",".join(map(str, users)), "--workload", WORKLOAD,
               "--seed", str(seed), "--results", results, "--figure", figure, "--timeout", "120",
               "--deadline", "120"]
    subprocess.run(command, check=True, timeout=timeout)


def measure(users: Sequence[int] = USERS, seed: int = 0, threads: int = 1, results: str = "15_core_process_cpu",
            figure: str = "15_latency_vs_users") -> dict[str, Any]:
    """Both servers under the load generator, then the engine offline on the biggest level's
    requests; writes benchmarks/results/<results>.json (bench-serve's levels and this
    chapter's summary) and figures/<figure>.png. Returns the summary."""
    path = RESULTS_DIR / f"{results}.json"
    path.unlink(missing_ok=True)  # this run's servers only
    folder = Path(tempfile.mkdtemp(prefix="minivllm-cheap-"))
    try:
        model = write_cheap_model(folder)
        load_before = os.getloadavg()
        with cli_server(model, "thread", threads) as one, cli_server(model, "process", threads) as split:
            load_generator([one, split], list(SERVERS), users, results, figure, seed)
        offline = offline_run(model, max(users), seed, threads)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    payload = json.loads(path.read_text())
    runs = payload["runs"]["concurrency"]
    summary: dict[str, Any] = {"model": {"shape": CHEAP_SHAPE, "tokenizer": "the embedded model's"},
                               "workload": WORKLOAD, "engine": ENGINE, "threads": threads,
                               "load_average_at_start": load_before, "load_average_at_end": os.getloadavg(),
                               "offline": offline, "servers": {}}
    step = offline["step_seconds_p50_full_batch"]
    for label in SERVERS:
        levels = runs[label]["levels"]
        biggest = next(lv for lv in levels if lv["concurrency"] == max(users))
        summary["servers"][label] = {
            "fraction_of_offline_at_max_users": biggest["output_throughput"] / offline["output_throughput"],
            "levels": [{"users": lv["concurrency"], "output_throughput": lv["output_throughput"],
                        "itl_p50": lv.get("itl", {}).get("p50"), "ttft_p99": lv.get("ttft", {}).get("p99"),
                        "itl_p50_over_offline_step": (lv["itl"]["p50"] / step) if step and lv.get("itl") else None,
                        "load_average": lv["load_average"], "failed": lv["failed"]} for lv in levels],
        }
    payload["chapter15"] = summary
    save_results(results, payload)
    return summary
