"""One API server process against several (issue 48, `minivllm serve --api-server-count N`), on a CPU.

    python benchmarks/api_servers_cpu.py [--users 128] [--counts 1,2] [--rounds 2]

frontend_cpu.py's measurement (the cheap 2-layer model with the embedded tokenizer, one torch
thread in the core, the chat workload, a closed loop of `--users` streams in this process, two
requests per user after a warm-up), with the server started with each API server count in turn,
the order alternating round by round. Per run: tokens per second the clients received, and the
CPU time per streamed token of all the API server processes together (with one, the `minivllm
serve` process itself) and of the core process. Writes benchmarks/results/48_api_servers_cpu.json.

What it can show on a 2-core machine shared with other work: whether N frontends cost more CPU
per token in all than one (each has its own event loop, tokenizer and HTTP parsing, and the core
sends each its own message per step), not the speed-up a host with free cores would see: the load
generator, the core's busy loop and every API server take turns on the same two cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_cpu import cpu_seconds, healthy  # a script beside this one

from minivllm.course.bench.harness import save_results
from minivllm.course.bench.load import run_level
from minivllm.course.bench.split_serving import (
    CHEAP_SHAPE,
    ENGINE,
    free_port,
    stop,
    write_cheap_model,
)
from minivllm.course.bench.workloads import make_workload
from minivllm.machine import environment


def start_server(model: Path, count: int) -> tuple[subprocess.Popen, str]:
    """`minivllm serve` with `count` API server processes (core process, one torch thread)."""
    port = free_port()
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--model", str(model), "--port", str(port),
               "--threads", "1", "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--num-kv-blocks",
               str(ENGINE["num_kv_blocks"]), "--max-waiting", "4096", "--api-server-count", str(count)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return server, healthy(server, f"http://127.0.0.1:{port}")


def processes(server: subprocess.Popen, url: str, count: int) -> tuple[list[psutil.Process], psutil.Process]:
    """The API server processes (with one: `minivllm serve` itself) and the core process."""
    parent = psutil.Process(server.pid)
    core = psutil.Process(httpx.get(f"{url}/server_info", trust_env=False).json()["core_pid"])
    if count == 1:
        return [parent], core
    api_servers = [p for p in parent.children() if p.pid != core.pid and "resource_tracker" not in " ".join(p.cmdline())]
    assert len(api_servers) == count, api_servers
    return api_servers, core


def measure(model: Path, count: int, users: int, seed: int) -> dict[str, Any]:
    server, url = start_server(model, count)
    try:
        api_servers, core = processes(server, url, count)
        name = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        warm = make_workload("chat", vocab, seed=seed + 1, num_requests=users)
        asyncio.run(run_level(url, name, warm, concurrency=users, timeout=120, deadline=300))  # first-call costs
        work = make_workload("chat", vocab, seed=seed, num_requests=2 * users)
        before = sum(cpu_seconds(p) for p in api_servers), cpu_seconds(core)
        results, seconds = asyncio.run(run_level(url, name, work, concurrency=users, timeout=120, deadline=300))
        after = sum(cpu_seconds(p) for p in api_servers), cpu_seconds(core)
    finally:
        stop(server)
    tokens = sum(r.output_tokens for r in results)
    return {"api_servers": count, "tokens": tokens, "failed": sum(not r.ok for r in results), "seconds": seconds,
            "tok_per_s": tokens / seconds, "frontend_us_per_token": 1e6 * (after[0] - before[0]) / tokens,
            "core_us_per_token": 1e6 * (after[1] - before[1]) / tokens, "load_average": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=128)
    parser.add_argument("--counts", default="1,2", help="API server counts, measured in turns")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="48_api_servers_cpu")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="minivllm-cheap-"))
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    try:
        model = write_cheap_model(folder / "model")
        for round_ in range(args.rounds):
            for n in (counts if round_ % 2 == 0 else counts[::-1]):
                run = measure(model, n, args.users, args.seed)
                runs[n].append(run)
                print(f"round {round_}, {n} API server(s): {run['tok_per_s']:.0f} tok/s, frontend "
                      f"{run['frontend_us_per_token']:.1f} us/token, core {run['core_us_per_token']:.1f} us/token, "
                      f"load {run['load_average'][0]:.1f}", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {n: {key: statistics.median(r[key] for r in rs)
                   for key in ("tok_per_s", "frontend_us_per_token", "core_us_per_token")} for n, rs in runs.items()}
    payload = {"machine": environment() | {"cpu_count": os.cpu_count()},
               "model": {"shape": CHEAP_SHAPE, "tokenizer": "the embedded model's"}, "engine": ENGINE,
               "workload": "chat", "streams": args.users, "requests_per_run": 2 * args.users,
               "medians_by_api_server_count": medians, "runs": runs,
               "command": " ".join(["python", "benchmarks/api_servers_cpu.py"] + sys.argv[1:])}
    save_results(args.results, payload)


if __name__ == "__main__":
    main()
