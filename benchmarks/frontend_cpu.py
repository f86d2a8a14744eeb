"""What one streamed token costs the server's frontend process, in CPU time (issue 48).

    python benchmarks/frontend_cpu.py [--users 128] [--rounds 3] [--compare DIR] [--hide MODULE ...] [--profile]
    python benchmarks/frontend_cpu.py --split 8,128 [--users 128] [--rounds 3]

A GPU steps a batch of 128 in milliseconds; then the frontend (HTTP, detokenizing, JSON, one
server-sent event per token) is what limits a server, and its CPU time per streamed token says
how many tokens per second one frontend core can stream. Measured as chapter 15 does it, in the
regime of a fast GPU on a CPU: `minivllm serve` (core process) on the cheap 2-layer model with the
embedded tokenizer (course/bench/split_serving.py), the load generator (`run_level`, closed
loop, chat workload, 2 requests per user) in this process. Per run: the frontend process's CPU
seconds (user + system) and its core process's, over the tokens the clients received.

--compare DIR runs another checkout's server (say, the code before a change) in turns with this
one, round by round, the order alternating, and reports medians: the machine is shared, so
only numbers taken side by side compare. --hide MODULE ... runs the compare side (this checkout
again when --compare is not given) as if those modules were not installed: `--hide uvloop
httptools` measures what uvicorn's C HTTP parser and libuv loop save (without them it falls back
to h11 and asyncio's own loop). --profile adds one run of this checkout's frontend
sampled by py-spy (pip install py-spy) over the measured requests only, and keeps the functions
with the largest share of the frontend's busy samples, their own and with what they call.
Writes benchmarks/results/48_frontend_cpu.json.

--split SHORT,LONG asks what of that cost is per request and what per token: the chat workload's
prompts, every request asking for SHORT tokens, then every one for LONG (in turns, round by
round); the frontend's CPU seconds then fit cpu = requests x per_request + tokens x per_token
(two lengths, two unknowns, from the medians). Writes benchmarks/results/48_frontend_cpu_split.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import psutil

from minivllm.course.bench.harness import save_results
from minivllm.course.bench.load import run_level
from minivllm.course.bench.split_serving import (
    CHEAP_SHAPE,
    ENGINE,
    free_port,
    stop,
    wait_until_up,
    write_cheap_model,
)
from minivllm.course.bench.workloads import Workload, make_workload
from minivllm.machine import environment

HERE = Path(__file__).resolve().parents[1]  # this checkout


def hiding(modules: list[str], folder: Path) -> str:
    """A folder whose sitecustomize.py (run by every interpreter that has the folder on its
    PYTHONPATH) makes `modules` unimportable, as if they were not installed; '' for none."""
    if not modules:
        return ""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None  # import {name} raises ImportError\n"
                                  for name in modules))
    return str(folder)


def start_server(model: Path, code: Path, hidden: str = "") -> tuple[subprocess.Popen, str]:
    """`minivllm serve` (core process, one torch thread) from checkout `code`; returns it and its url.
    hidden: a folder made by `hiding`, put first on the server's PYTHONPATH."""
    port = free_port()
    command = [sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--model", str(model), "--port", str(port),
                     "--threads", "1", "--engine-core", "process", "--max-num-seqs", str(ENGINE["max_num_seqs"]),
                     "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--max-waiting", "4096"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (hidden, str(code))))))
    return server, healthy(server, f"http://127.0.0.1:{port}")


def healthy(server: subprocess.Popen, url: str) -> str:
    """`url` once the server there answers /health with 200; a RuntimeError (and the server stopped)
    if it exits first or takes longer than START_TIMEOUT."""
    try:
        wait_until_up("the server", server, f"{url}/health", server.stderr.read)
    except RuntimeError:
        stop(server)
        raise
    return url


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure(model: Path, code: Path, users: int, seed: int, profile: Path | None = None,
            hidden: str = "", output_len: int | None = None) -> dict[str, Any]:
    """One server from `code` under `users` streams: CPU per token of its frontend and its core.
    output_len: every request asks for that many tokens (None: the chat workload's lengths)."""
    server, url = start_server(model, code, hidden)
    try:
        frontend = psutil.Process(server.pid)
        name = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"][0]["id"]
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        warm = make_workload("chat", vocab, seed=seed + 1, num_requests=users)
        asyncio.run(run_level(url, name, warm, concurrency=users, timeout=120, deadline=300))  # first-call costs
        work = make_workload("chat", vocab, seed=seed, num_requests=2 * users)
        if output_len is not None:
            work = Workload(work.name, work.prompts, [output_len] * len(work.prompts))
        cores = frontend.children()
        spy = None if profile is None else subprocess.Popen(
            ["py-spy", "record", "--pid", str(server.pid), "--rate", "250", "--format", "raw", "--output", str(profile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = cpu_seconds(frontend), sum(cpu_seconds(c) for c in cores)
        results, seconds = asyncio.run(run_level(url, name, work, concurrency=users, timeout=120, deadline=300))
        after = cpu_seconds(frontend), sum(cpu_seconds(c) for c in cores)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
            spy.wait(60)
    finally:
        stop(server)
    tokens = sum(r.output_tokens for r in results)
    failed = sum(not r.ok for r in results)
    chunks = sum(len(r.token_times) for r in results)  # fewer than tokens where coalescing merged steps
    return {"code": str(code), "requests": len(results), "tokens": tokens, "failed": failed,
            "frontend_cpu_seconds": after[0] - before[0], "seconds": seconds, "tok_per_s": tokens / seconds,
            "chunks_per_token": chunks / tokens, "frontend_us_per_token": 1e6 * (after[0] - before[0]) / tokens,
            "core_us_per_token": 1e6 * (after[1] - before[1]) / tokens, "load_average": os.getloadavg()}


def split(model: Path, users: int, rounds: int, seed: int, lengths: tuple[int, int]) -> dict[str, Any]:
    """--split: the same requests asking for lengths[0] and then lengths[1] tokens each, in turns;
    the frontend's CPU per request and per token from the medians (cpu = a x requests + b x tokens)."""
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in lengths}
    for round_ in range(rounds):
        for n in (lengths if round_ % 2 == 0 else lengths[::-1]):
            run = measure(model, HERE, users, seed, output_len=n)
            runs[n].append(run)
            print(f"round {round_}, {n} tokens a request: frontend {run['frontend_us_per_token']:.1f} us/token "
                  f"({run['frontend_cpu_seconds']:.2f} s for {run['requests']} requests), load {run['load_average'][0]:.1f}")
    short, long = ({key: statistics.median(r[key] for r in runs[n]) for key in ("frontend_cpu_seconds", "requests", "tokens")}
                   for n in lengths)
    per_token = (long["frontend_cpu_seconds"] - short["frontend_cpu_seconds"]) / (long["tokens"] - short["tokens"])
    per_request = (short["frontend_cpu_seconds"] - per_token * short["tokens"]) / short["requests"]
    print(f"frontend: {1e6 * per_token:.1f} us per streamed token, {1e3 * per_request:.2f} ms per request")
    return {"lengths": list(lengths), "runs": {str(n): rs for n, rs in runs.items()},
            "frontend_us_per_token": 1e6 * per_token, "frontend_ms_per_request": 1e3 * per_request}


def profile_summary(path: Path, top: int = 30) -> dict[str, Any]:
    """py-spy's samples (collapsed stacks, "frame;frame;... count"): each function's share of the
    busy samples, on top of the stack (its own time) and anywhere in it (with what it calls)."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1] + ")"
                  for f in stack.split(";")]
        n = int(count)
        samples += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
    share = lambda table: [{"function": f, "share": c / samples}
                           for f, c in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
    return {"samples": samples, "own": share(own), "inclusive": share(total)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", type=Path, default=None, help="another checkout, measured in turns with this one")
    parser.add_argument("--hide", nargs="+", default=[], metavar="MODULE",
                        help="run the compare side (this checkout if no --compare) without these modules")
    parser.add_argument("--profile", action="store_true", help="one more run of this checkout, sampled by py-spy")
    parser.add_argument("--split", default=None, metavar="SHORT,LONG",
                        help="CPU per request and per token, from requests of SHORT and of LONG tokens")
    parser.add_argument("--results", default=None, help="default: 48_frontend_cpu (with --split: 48_frontend_cpu_split)")
    args = parser.parse_args()
    if any(not name.isidentifier() for name in args.hide):
        parser.error(f"--hide takes module names, got {args.hide}")
    if args.users < 1 or args.rounds < 1:
        parser.error("--users and --rounds must be at least 1")
    if args.split is not None:
        try:
            lengths = tuple(int(n) for n in args.split.split(","))
        except ValueError:
            parser.error(f"--split: two comma-separated token counts, got {args.split!r}")
        if len(lengths) != 2 or not 1 <= lengths[0] < lengths[1]:
            parser.error(f"--split: SHORT,LONG with 1 <= SHORT < LONG, got {args.split!r}")
        if args.compare or args.hide or args.profile:
            parser.error("--split measures this checkout alone: not with --compare, --hide or --profile")
        folder = Path(tempfile.mkdtemp(prefix="minivllm-cheap-"))
        try:
            found = split(write_cheap_model(folder / "model"), args.users, args.rounds, args.seed, lengths)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        save_results(args.results or "48_frontend_cpu_split", {
            "machine": environment() | {"cpu_count": os.cpu_count()},
            "model": {"shape": CHEAP_SHAPE, "tokenizer": "the embedded model's"}, "engine": ENGINE,
            "workload": f"chat prompts, {lengths[0]} or {lengths[1]} tokens a request", "streams": args.users,
            "requests_per_run": 2 * args.users, **found,
            "command": " ".join(["python", "benchmarks/frontend_cpu.py"] + sys.argv[1:])})
        return
    codes = {"this": HERE}
    if args.compare or args.hide:
        codes["compare"] = args.compare.resolve() if args.compare else HERE
    folder = Path(tempfile.mkdtemp(prefix="minivllm-cheap-"))
    hidden = {"this": "", "compare": hiding(args.hide, folder / "hidden")}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in codes}
    try:
        model = write_cheap_model(folder / "model")
        for round_ in range(args.rounds):
            order = list(codes) if round_ % 2 == 0 else list(codes)[::-1]
            for name in order:
                run = measure(model, codes[name], args.users, args.seed, hidden=hidden[name])
                runs[name].append(run)
                print(f"round {round_} {name}: frontend {run['frontend_us_per_token']:.1f} us/token, core "
                      f"{run['core_us_per_token']:.1f} us/token, {run['tok_per_s']:.0f} tok/s, "
                      f"{run['chunks_per_token']:.2f} chunks/token, load {run['load_average'][0]:.1f}")
        profile = None
        if args.profile:
            run = measure(model, HERE, args.users, args.seed, profile=folder / "frontend.txt")
            profile = {"run": run, "py_spy": profile_summary(folder / "frontend.txt")}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {name: {key: statistics.median(r[key] for r in rs)
                      for key in ("frontend_us_per_token", "core_us_per_token", "tok_per_s", "chunks_per_token")}
               for name, rs in runs.items() if rs}
    for name, m in medians.items():
        print(f"{name} ({codes[name]}): median frontend {m['frontend_us_per_token']:.1f} us/token, "
              f"core {m['core_us_per_token']:.1f}, {m['tok_per_s']:.0f} tok/s, {m['chunks_per_token']:.2f} chunks/token")
    payload = {"machine": environment() | {"cpu_count": os.cpu_count()},
               "model": {"shape": CHEAP_SHAPE, "tokenizer": "the embedded model's"}, "engine": ENGINE,
               "workload": "chat", "streams": args.users, "requests_per_run": 2 * args.users,
               "codes": {name: str(path) for name, path in codes.items()},
               "hidden_on_compare_side": args.hide, "medians": medians, "runs": runs,
               "profile": profile, "command": " ".join(["python", "benchmarks/frontend_cpu.py"] + sys.argv[1:])}
    save_results(args.results or "48_frontend_cpu", payload)


if __name__ == "__main__":
    main()
