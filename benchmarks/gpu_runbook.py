"""Every GPU number of the book in one command, inside one budget (README, "On a GPU").

    python benchmarks/gpu_runbook.py --out DIR [--budget 540] [--parts smoke,roofline,...] [--device cuda|cpu]
                                     [--archive FILE.tar.gz] [--wheels .whl] [--model SRC]

Why one command: a lent GPU gives 15 minutes in all, start-up included, and at most 10 minutes per
command. So the parts run in one call, in priority order, each under min(its limit, what is left of
--budget), and nothing finished is lost when time runs out:
- each part runs in a process group of its own, in DIR (its scripts write DIR/benchmarks/results/
  *.json and DIR/figures/*.png, the names they have in the repository), its output in DIR/NN_name.log;
  a part that fails or overruns is killed with everything it started, and the next part runs;
- the long parts save their results after every row, level or stage (roofline, serving, tour),
  marked "complete": false until the last, so a part killed at its limit still reports the rows it
  finished; the short ones (chapter scripts of 15-65 s on an H200) save at their end;
- DIR/runbook.json (the machine: GPU, driver, CUDA, torch, Triton, transformers; each part's status,
  time and headline numbers) and the --archive (DIR packed into one .tar.gz: the GPU machine returns
  files, not folders) are rewritten after every part.

 priority part            what                                                   H200     limit
 1        smoke           Qwen3-0.6B shape: the default engine (graphs, fused,    41 s      60 s
                          Triton, async scheduling) against the eager one, fp32
                          identical; bf16
 2        gpu_checks      pytest -m gpu: fp32 against transformers or the eager   ~40 s     70 s
                          engine (tests/test_gpu_checks.py and the chapters')
 3        roofline        nano workload: graphs+fused+async, graphs+fused,       ~90 s    130 s
                          graphs, eager (each row saved as it ends), then
                          transformers on 64 requests until 15 s before the
                          part's limit, counting the requests it finished
 4        serving         `minivllm serve` in its own process, `minivllm        ~150 s    200 s
                          bench-serve` in another, 1, 8, 32, 128, 256 users, 4
                          requests per user per level; chapter 10's one-process
                          server, then chapter 15's core process
 5        overlap         chapter 16: a decode step at batch 256, contexts       ~40 s     60 s
                          ~600, synchronous against async scheduling
 6        speculation     chapter 12: a verify step (k = 4) from graphs against  ~40 s     60 s
                          a decode step at batch 1-256; the embedded model's
                          n-gram speed-up at batch 1
 7        step_profile    chapter 9: one decode step at batch 256, contexts       28 s      60 s
                          ~600: eager, graphs, graphs + fused, + async
 8        kernel          chapter 8: decode kernel vs SDPA and copy bandwidth     20 s      40 s
 9        tour            minivllm tour on tour_gpu (16 requests, fp32): every   (goal      170 s
                          stage on every request, = transformers checked         <300 s)
 10       peer            transformers' continuous batching under the settings   ~80 s     110 s
                          its guide offers, 16 nano requests, 15 s each
 11       prefix_caching  chapter 11: 256 requests sharing a 200-token prompt;  ~90 s     120 s
                          the shared-share sweep on 64 requests, median of 3

The H200 column is what the part took on one H200 at 7d18199 (../shared/measured/h200-2026-11-26/),
or an estimate from it; limits are 1.3-2x that. They sum to 1,080 s, more than the 540 s budget: the
parts at the end get what the ones before leave, which on an H200 may be nothing for the tour and
prefix caching (run them alone with --parts tour,prefix_caching when they matter).

Adding a part is one entry in PARTS: a name, a limit in seconds, a line saying what it measures, a
`summarize` that reads its headline from the files it wrote, and either `command` (a function of the
Run giving the arguments after `python`) or `function` (a function of the Run doing the work in the
part's own process). Its place in the list is its priority. A Run carries the device, the model's
arguments, DIR, the part's limit and deadline (time.time()) and `save`, for results written row by
row. A server measured over HTTP is one call of serve_and_load: the parts serving, api_servers (issue
48: `--api-server-count` 1, 2 and 4 at 128 and 256 users, after serving; ~150 s, limit 200 s) and
data_parallel are three such calls.

`--device cpu` is a dry run of the same code with the embedded model (or --model) and tiny
workloads, each part's torch on one thread (tests/test_gpu_runbook.py runs it).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_MODEL = str(ROOT / "minivllm" / "configs" / "qwen3-0.6b.json")
# Modules the serving part and the GPU checks import that a bare GPU machine lacks: installed from --wheels.
EXTRA_MODULES = ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client", "zmq", "msgspec", "xgrammar", "jsonschema")


@dataclass
class Run:
    """What a part is given: where it runs and until when."""

    device: str  # "cuda", or "cpu" for the dry run
    model: list[str]  # the --model arguments of the scripts that take one
    out: Path  # DIR: the part's working directory
    limit: float  # seconds this part may take: min(its limit, what is left of the budget)
    deadline: float = 0.0  # time.time() by which it must have ended

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self, name: str, payload: dict[str, Any], complete: bool) -> Path:
        """Write DIR/benchmarks/results/<name>.json now (complete=False while rows are still coming)."""
        path = self.out / "benchmarks" / "results" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(payload | {"complete": complete}, indent=2, default=str) + "\n")
        partial.replace(path)
        return path


@dataclass(frozen=True)
class Part:
    name: str
    limit: float  # seconds on a GPU
    what: str
    summarize: Callable[[Run], dict[str, Any]]  # headline numbers from the files it wrote in DIR
    command: Callable[[Run], list[str]] | None = None  # the arguments after `python`
    function: Callable[[Run], None] | None = None  # or: work done in the part's own process
    cpu_limit: float | None = None  # the dry run's limit, if not `limit`


def script(*path: str) -> str:
    return str(ROOT.joinpath(*path))


def results(run: Run, name: str) -> dict[str, Any]:
    return json.loads((run.out / "benchmarks" / "results" / f"{name}.json").read_text())


def completeness(payload: dict[str, Any]) -> dict[str, Any]:
    """{"complete": False} for a results file its script did not finish, nothing otherwise."""
    return {} if payload.get("complete", True) else {"complete": False}


# ---- smoke ---------------------------------------------------------------------------------------------------

def smoke_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"gpu_smoke_{run.device}")
    return {dtype: f"{r['agreement']['identical_requests']}/{r['agreement']['requests']} requests identical, "
                   f"{r['agreement']['tokens_before_first_difference']:.0%} of tokens before a difference"
            for dtype, r in payload["runs"].items()}


def smoke(run: Run) -> list[str]:
    return [script("benchmarks", "gpu_smoke.py"), "--device", run.device, *run.model,
            *([] if run.gpu else ["--requests", "2", "--max-tokens", "4"])]


# ---- roofline ------------------------------------------------------------------------------------------------

def roofline(run: Run) -> list[str]:
    size = ["--workload", "nano", "--peer-requests", "64"] if run.gpu else ["--workload", "tiny", "--requests", "4",
                                                                             "--peer-requests", "2"]
    return [script("benchmarks", "engine_roofline.py"), "--device", run.device, *run.model, *size,
            "--peer-variants", "graphs+fused" if run.gpu else "eager", "--time-limit", f"{run.limit:.0f}"]


def roofline_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"09_roofline_{run.device}")
    return {row["name"]: {"s": round(row["median_seconds"], 2), "tok/s": round(row["tokens_per_second"]),
                          "of roofline": row["share_of_roofline"] and round(row["share_of_roofline"], 3),
                          "of datasheet roofline": (None if row.get("share_of_datasheet_roofline") is None
                                                    else round(row["share_of_datasheet_roofline"], 3)),
                          "requests": row["requests_finished"],
                          "x transformers": row.get("speedup_over_transformers"),
                          "same tokens": row["same_tokens_as_engine"]}
            for row in payload["rows"]} | completeness(payload)


# ---- serving: a server process and a load-generator process per level -----------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(url: str, server: subprocess.Popen, deadline: float) -> None:
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} was not healthy in time")


def serve_and_load(run: Run, results: str, servers: dict[str, list[str]], levels: list[int], workload: str,
                   figure: str) -> None:
    """For each server (a label and its `minivllm serve` arguments, in order): start it in a process
    of its own, then run `minivllm bench-serve` once per level in another (at least 4 requests per
    user, so a level is a steady state rather than one burst), and save DIR/benchmarks/results/
    <results>.json after every level. The server is in this part's process group: a part killed at
    its limit takes it along. A later chapter's serving part is this call with its own servers."""
    payload: dict[str, Any] = dict(benchmark="serving over HTTP: `minivllm serve` and `minivllm bench-serve`, "
                                             "each in a process of its own", workload=workload, servers=servers, runs={})
    for label, arguments in servers.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", "serve", "--device", run.device, *run.model,
                                   "--port", str(port), *arguments], cwd=run.out)
        try:
            wait_until_healthy(url, server, min(run.deadline, time.time() + 120))
            print(f"{label} server at {url}", flush=True)
            done = payload["runs"].setdefault(label, [])
            for users in levels:
                scratch = run.out / "serving" / f"{results}_{label}_{users}".replace(" ", "_")
                scratch.mkdir(parents=True, exist_ok=True)
                left = run.left() - 10
                if left < 5:
                    print(f"no time left for {label} at {users} users", flush=True)
                    break
                subprocess.run([sys.executable, "-m", "minivllm.entrypoints.cli", "bench-serve", "--url", url, "--concurrency",
                                str(users), "--requests", str(max(4, 4 * users)), "--workload", workload,
                                "--label", label, "--results", "level", "--figure", "level",
                                "--deadline", f"{left:.0f}"], cwd=scratch, timeout=left + 5, check=True)
                level = json.loads((scratch / "benchmarks" / "results" / "level.json").read_text())
                done.extend(level["runs"]["concurrency"][label]["levels"])
                run.save(results, payload, complete=False)
        finally:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
    from minivllm.course.plots import save
    from minivllm.course.plots.serving import plot_serving

    # The part's process runs in DIR, so figures/ lands there.
    save(plot_serving(payload["runs"], "concurrency", 0.5, 50.0, subtitle=f"workload {workload} (EOS ignored), "
                      "server and load generator in processes of their own"), figure)
    run.save(results, payload, complete=True)


def serving(run: Run) -> None:
    """Chapter 10's one-process server (the engine in a thread beside the event loop) against chapter
    15's (the engine core in a process of its own), on the same requests."""
    settings = ["--num-kv-blocks", "16384"] if run.gpu else ["--threads", "1"]
    serve_and_load(run, f"15_serving_{'gpu' if run.gpu else 'cpu'}",
                   {"one process (ch10)": [*settings, "--engine-core", "thread"], "core process (ch15)": settings},
                   [1, 8, 32, 128, 256] if run.gpu else [2], "ladder_gpu" if run.gpu else "tiny",
                   "15_latency_vs_users" + ("_gpu" if run.gpu else "_dry_run"))


def api_servers(run: Run) -> None:
    """Issue 48: the core-process server with 1, 2 and 4 API server processes (`--api-server-count`)
    at 128 and 256 users, where one frontend process stopped growing on the H200 (11,336 tok/s at
    128 users, 12,211 at 256). The dry run starts only the 2-process server, at 2 users."""
    settings = ["--num-kv-blocks", "16384"] if run.gpu else ["--threads", "1"]
    counts = [1, 2, 4] if run.gpu else [2]
    serve_and_load(run, f"48_api_servers_{'gpu' if run.gpu else 'dry_run'}",
                   {f"{n} API server{'s' if n > 1 else ''}": [*settings, "--api-server-count", str(n)] for n in counts},
                   [128, 256] if run.gpu else [2], "ladder_gpu" if run.gpu else "tiny",
                   "48_api_servers" + ("_gpu" if run.gpu else "_dry_run"))


def api_servers_summary(run: Run) -> dict[str, Any]:
    return levels_summary(f"48_api_servers_{'gpu' if run.gpu else 'dry_run'}")(run)


def data_parallel(run: Run) -> None:
    """Chapter 14's copies where only one GPU is lent: one core process against two copies of the
    model, each a core process with half the KV cache, taking turns on the same GPU (on the CPU
    dry run, on the same threads). Copies pay on one device only where one core leaves it idle."""
    one = ["--num-kv-blocks", "16384"] if run.gpu else ["--threads", "1"]
    two = ["--num-kv-blocks", "8192"] if run.gpu else ["--threads", "1"]
    serve_and_load(run, f"14_data_parallel_{'gpu' if run.gpu else 'cpu'}",
                   {"one core (ch15)": one, "two copies (ch14)": [*two, "--data-parallel-size", "2"]},
                   [32, 128, 256] if run.gpu else [2], "ladder_gpu" if run.gpu else "tiny",
                   "14_copies_on_one_device" + ("_gpu" if run.gpu else "_dry_run"))


def data_parallel_summary(run: Run) -> dict[str, Any]:
    return levels_summary(f"14_data_parallel_{'gpu' if run.gpu else 'cpu'}")(run)


def levels_summary(results_name: str) -> Callable[[Run], dict[str, Any]]:
    """The headline of a serve_and_load part: by server, the levels where the SLO held, TTFT p99
    and total tok/s by users."""
    def summarize(run: Run) -> dict[str, Any]:
        payload = results(run, results_name)
        return {label: {"SLO held at users": [lv["concurrency"] for lv in levels if lv["slo_met"]],
                        "TTFT p99 ms by users": {lv["concurrency"]: round(1e3 * lv["ttft"]["p99"]) if "ttft" in lv
                                                 else None for lv in levels},
                        "tok/s by users": {lv["concurrency"]: round(lv["output_throughput"]) for lv in levels}}
                for label, levels in payload["runs"].items()} | completeness(payload)

    return summarize


def serving_summary(run: Run) -> dict[str, Any]:
    return levels_summary(f"15_serving_{'gpu' if run.gpu else 'cpu'}")(run)


def overlap(run: Run) -> list[str]:
    size = (["--batch-size", "256", "--context", "600", "--steps", "20", "--device-ms", "2"] if run.gpu else
            ["--batch-size", "4", "--context", "40", "--steps", "3", "--device-ms", "2"])
    return [script("chapters", "16_async_scheduling.py"), "--device", run.device, *run.model, *size, "--out", "."]


def overlap_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"16_async_scheduling_{run.device}")
    summary = {"same tokens": payload["sample"]["same_tokens"]}
    gpu = payload.get("gpu")
    if gpu:
        summary |= {name: {"step ms": round(gpu[name]["plain_step_ms"], 2),
                           "GPU busy ms": round(gpu[name]["device_busy_ms"], 2),
                           "step / busy": round(gpu[f"{name}_step_over_busy"], 3)} for name in ("sync", "async")}
    return summary


# ---- the others ----------------------------------------------------------------------------------------------

def kernel(run: Run) -> list[str]:
    return [script("chapters", "08_triton_kernel.py"), "--device", run.device,
            *(["--e2e-requests", "0", "--skip-flex", "--skip-split-sweep"] if run.gpu else [])]


def kernel_summary(run: Run) -> dict[str, Any]:
    if not run.gpu:
        return {"max error vs float64": max(results(run, "08_triton_kernel_cpu_check")["errors"].values())}
    payload = results(run, "08_triton_kernel")
    goals = payload["goals"]
    return {"copy bandwidth GB/s": round(payload["copy_bandwidth_gbs"]),
            "triton / SDPA by context": dict(zip(payload["contexts"], [None if r is None else round(r, 2)
                                                                     for r in goals["ratio_vs_sdpa"]])),
            "of copy at 64 x 4,096": goals["of_copy_at_target"],
            "uneven batch, of copy / of datasheet": {r["name"]: [round(r["of_copy"], 3), r["of_datasheet"] and
                                                                  round(r["of_datasheet"], 3)]
                                                     for r in (payload.get("uneven") or {}).get("rows", [])}}


def gpu_checks(run: Run) -> list[str]:
    return ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", script("tests"),
            "--continue-on-collection-errors", "--junitxml", "gpu_tests.xml", "-rs"]


def checks_summary(run: Run) -> dict[str, Any]:
    suite = ElementTree.parse(run.out / "gpu_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return counts | dict(passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"])


def step_profile(run: Run) -> list[str]:
    size = ["--batch-size", "256", "--context", "600"] if run.gpu else ["--batch-size", "4", "--context", "40",
                                                                        "--steps", "2"]
    return [script("chapters", "09_cuda_graphs.py"), "--device", run.device, *run.model, *size, "--out", "."]


def profile_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"09_cuda_graphs_{run.device}")
    return {p["variant"]: {"plain step ms": round(p["summary"]["plain_step_ms"], 2),
                           "profiled step ms": round(p["summary"]["wall_ms"], 2),
                           "device busy ms": p["summary"]["device_busy_ms"] and round(p["summary"]["device_busy_ms"], 2),
                           p["count_label"]: p["summary"]["launches"], "same tokens": payload["same_tokens"][p["variant"]]}
            for p in payload["profiles"]}


def speculation(run: Run) -> list[str]:
    """Chapter 12 on the device: verify steps replayed from graphs against decode steps (the shape's
    random weights), then the embedded model's n-gram speed-up at batch 1 (real weights)."""
    return [script("chapters", "12_speculative_decoding.py"), "--device", run.device, *run.model, "--runbook",
            *(["--k", "4"] if run.gpu else ["--batches", "1", "2", "--k", "2", "--output-tokens", "24",
                                            "--prompt-tokens", "64", "--repeats", "1"])]


def speculation_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"12_speculative_decoding_runbook_{run.device}")
    e2e = payload["end_to_end"]
    return {"verify (k + 1 tokens) / decode by batch, graphs": {r["batch_size"]: round(r["ratio"], 2)
                                                                for r in payload["verify_cost"]},
            "eager verify / decode by batch": {r["batch_size"]: round(r["eager_ratio"], 2)
                                               for r in payload["verify_cost"]},
            "embedded model n-gram / plain at batch 1": round(e2e["speedup"], 2), "same tokens": e2e["same_tokens"]}


def tour(run: Run) -> None:
    """`minivllm tour` with its GPU defaults (tour_gpu in fp32: every stage on every request, each
    checked against transformers on 4) under the part's time limit."""
    from minivllm.course.bench.tour import run_tour

    source = run.model[1] if run.model else None
    size = (dict(check=4) if run.gpu else
            dict(workload="tiny", num_requests=3, check=1, stages=["naive", "paged", "continuous", "cuda_graphs"],
                 peers=False))
    run_tour(source, device=run.device, time_limit=max(run.left() - 15, 1), **size)


def tour_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"tour_{run.device}_{'tour_gpu' if run.gpu else 'tiny'}")
    return {row["name"]: f"{row['tokens_per_second']:,.0f} tok/s, {row['speedup']:.1f}x, {row['agrees']}"
            for row in payload["rows"]} | {"seconds": round(payload["tour_seconds"])} | completeness(payload)


def peer(run: Run) -> list[str]:
    size = ["--requests", "16", "--seconds", "15"] if run.gpu else ["--requests", "2", "--seconds", "10"]
    return [script("benchmarks", "peer_settings.py"), "--device", run.device, *run.model, *size]


def peer_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"51_peer_settings_{run.device}")
    return {row["name"]: row.get("error") or f"{row['requests_finished']}/{row['requests']} requests, "
                                              f"{row['tokens_per_second']:,.0f} tok/s ({row['attn_used']})"
            for row in payload["rows"]} | completeness(payload)


def prefix_caching(run: Run) -> list[str]:
    # The sweep's 0 %-shared row is the same work with the cache on and off. On the H200 one run of 16
    # requests took under 0.1 s and that row read 1.43x: noise. 64 requests per run (~4x longer) and the
    # median of 3 interleaved repeats are meant to bring it to 1.0 +- 0.05 (not yet seen on a GPU:
    # the summary prints the row).
    size = (["--requests", "256", "--repeats", "2", "--rate", "64", "--shares", "0", "0.3", "0.6", "0.9",
             "--sweep-requests", "64", "--sweep-repeats", "3", "--chat-repeats", "1"] if run.gpu else
            ["--requests", "4", "--prefix", "16", "--repeats", "1", "--rate", "50", "--shares", "0", "0.5",
             "--sweep-prompt", "32", "--sweep-requests", "2", "--sweep-repeats", "1", "--conversations", "2",
             "--turns", "2", "--chat-repeats", "1"])
    return [script("chapters", "11_prefix_caching.py"), "--device", run.device, *run.model, *size]


def prefix_summary(run: Run) -> dict[str, Any]:
    payload = results(run, f"11_prefix_caching_{run.device}")
    headline, sweep = payload["headline"], payload["sweep"]
    counts = headline["counts"]
    return {"prompt tokens computed on / off": f"{counts['caching on']['prompt_tokens_computed']} / "
                                                f"{counts['caching off']['prompt_tokens_computed']}",
            "TTFT p50 off / on (all at once)": round(headline["speedups"]["at_once"]["ttft_p50"], 2),
            "throughput on / off": round(headline["speedups"]["at_once"]["tokens_per_second"], 2),
            "sweep TTFT p50 off / on by share": {share: round(s["ttft_p50"], 2)
                                                 for share, s in zip(sweep["shares"], sweep["speedups"])},
            "same tokens": headline["same_tokens"]}


PARTS: list[Part] = [  # in priority order: the budget runs out at the end of this list
    Part("smoke", 60, "default engine against eager, fp32 and bf16", smoke_summary, command=smoke),
    Part("gpu_checks", 100, "pytest -m gpu", checks_summary, command=gpu_checks),
    Part("roofline", 130, "nano workload against its memory floor", roofline_summary, command=roofline),
    Part("serving", 200, "one-process vs core-process server over HTTP, 1-256 users", serving_summary,
         function=serving),
    Part("api_servers", 200, "1, 2 and 4 API server processes in front of one core, 128 and 256 users",
         api_servers_summary, function=api_servers),
    Part("data_parallel", 150, "one core against two copies sharing the device, over HTTP, 32-256 users",
         data_parallel_summary, function=data_parallel),
    Part("overlap", 60, "a decode step at batch 256, synchronous vs async scheduling", overlap_summary,
         command=overlap),
    Part("speculation", 60, "verify step against decode step", speculation_summary, command=speculation),
    Part("step_profile", 60, "one decode step: eager, graphs, graphs+fused, +async", profile_summary,
         command=step_profile),
    Part("kernel", 40, "decode kernel against SDPA", kernel_summary, command=kernel, cpu_limit=60),
    Part("tour", 170, "the ladder, every stage under a budget", tour_summary, function=tour),
    Part("peer", 110, "transformers' continuous batching under each documented setting", peer_summary, command=peer),
    Part("prefix_caching", 120, "shared prompts, caching on against off", prefix_summary, command=prefix_caching),
]


# ---- running the parts ---------------------------------------------------------------------------------------

def machine(device: str) -> dict[str, Any]:
    """What the numbers were measured on: the GPU and its driver, the software, this tree."""
    import torch
    import transformers

    info: dict[str, Any] = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                                transformers=transformers.__version__, cpu_cores=os.cpu_count(), device=device,
                                load_average=os.getloadavg())
    info["triton"] = importlib.util.find_spec("triton") and __import__("triton").__version__
    if device == "cuda":  # from nvidia-smi: this process holds no CUDA context while the parts run
        gpu = run_quietly(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        info["gpu"], info["driver"], info["gpu_memory"] = ([f.strip() for f in gpu.split(",")][:3] if gpu and gpu.count(",") >= 2
                                                           else [None, None, None])
    info["tree"] = run_quietly(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    # A device's copy of the repository carries the session's first commit beside the working tree
    # it was sent: the tracked files that differ from that commit say whether "tree" is the code.
    info["changes_since_tree"] = run_quietly(["git", "-C", str(ROOT), "diff", "--shortstat", "HEAD"])  # None: none
    return info


def run_quietly(command: list[str]) -> str | None:
    """A command's first line of output, or None if it cannot run here."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def extra_packages(wheels: Path, log: Path) -> tuple[str, str | None]:
    """(what happened, a folder to put on the parts' PYTHONPATH). The server, its client and
    chapter 13 need FastAPI, uvicorn, httpx, openai, pyzmq, msgspec and xgrammar; a GPU machine without a registry
    gets them from the wheels tools/fetch_wheels.py downloaded, installed into a folder of their own."""
    missing = [name for name in EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return "installed already", None
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return f"missing {', '.join(missing)}, and no wheels in {wheels} (run tools/fetch_wheels.py where pip works)", None
    site = tempfile.mkdtemp(prefix="minivllm-wheels-")
    # Two installs: a wheel chapter 13 alone needs (xgrammar's) that does not fit this machine must not
    # keep the server's packages out.
    grammar = [w for w in found if w.name.startswith(("xgrammar", "apache_tvm_ffi"))]
    groups = [[w for w in found if w not in grammar], grammar]
    installed, failed = 0, []
    with log.open("w") as output:
        for group in filter(None, groups):
            command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                       "--disable-pip-version-check", "--target", site, *map(str, group)]
            if subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=120).returncode:
                failed += [w.name for w in group]
            else:
                installed += len(group)
    if not installed:
        return f"pip could not install the {len(found)} wheels of {wheels} (see {log.name})", None
    return (f"installed {installed} wheels from {wheels}"
            + (f"; pip could not install {', '.join(failed)} (see {log.name})" if failed else "")), site


def part_environment(device: str, extra_path: str | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # GPU parts compile their kernels
    else:
        # One thread per part. torch starts one per core, and on a small machine busy with other
        # work its threads wait for each other at every operator (a barrier per call): a dry-run
        # step of the tiny model measured 359 ms that way on a loaded 2-core machine.
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def run_part(part: Part, number: int, run: Run, extra_path: str | None) -> dict[str, Any]:
    """Run one part in its own process group until run.deadline; kill the group if it overruns."""
    if part.command:
        command = [sys.executable, *part.command(run)]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--run-part", part.name, "--out", str(run.out),
                   "--device", run.device, "--part-limit", f"{run.limit}", *run.model]
    log = run.out / f"{number:02d}_{part.name}.log"
    start = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=run.out, env=part_environment(run.device, extra_path), stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=max(run.left(), 0))
            status = "ok" if returncode == 0 else f"failed (exit status {returncode})"
        except subprocess.TimeoutExpired:
            stop(process)
            status = f"timed out after {run.limit:.0f} s"
    row: dict[str, Any] = dict(part=number, name=part.name, status=status, seconds=round(time.perf_counter() - start, 1),
                               limit=round(run.limit), command=command, log=log.name)
    try:
        row["summary"] = part.summarize(run)
    except Exception as error:  # the part failed before writing them, or wrote something else
        row["summary"] = {"results": f"not readable: {type(error).__name__}: {error}"}
    return row


def stop(process: subprocess.Popen) -> None:
    """End a part's process group (it started it: servers, workers): politely, then for good."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def parse_parts(text: str) -> list[Part]:
    """Part names (or numbers, 1-based, in priority order), comma-separated; run in priority order."""
    names = [part.name for part in PARTS]
    chosen = []
    for item in text.split(","):
        item = item.strip()
        name = names[int(item) - 1] if item.isdigit() and 1 <= int(item) <= len(names) else item
        if name not in names or name in chosen:
            raise argparse.ArgumentTypeError(f"parts are {', '.join(names)} (or 1-{len(names)}), each once; "
                                             f"got {text!r}")
        chosen.append(name)
    return [part for part in PARTS if part.name in chosen]


def pack(out: Path, archive: Path) -> None:
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as packed:
        packed.add(out, arcname=out.name, filter=lambda info: None if Path(info.name).name in (archive.name, partial.name)
                   else info)
    partial.replace(archive)


def run_one_function_part(args: argparse.Namespace, model: list[str]) -> int:
    """The process of a function part (`--run-part NAME`)."""
    part = next(p for p in PARTS if p.name == args.run_part)
    run = Run(args.device, model, args.out.resolve(), args.part_limit, time.time() + args.part_limit)
    part.function(run)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the results, figures, logs and summary")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all the parts together (default 540)")
    parser.add_argument("--parts", type=parse_parts, default=PARTS, help="comma-separated part names (default: all)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run with tiny sizes")
    parser.add_argument("--archive", type=Path, default=None, help="also pack DIR into this .tar.gz after every part")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels for FastAPI & co. (fetch_wheels)")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="multiply every part's limit by this")
    parser.add_argument("--model", default=None, help="the model of the parts that take one (default: the Qwen3-0.6B "
                                                      "shape on a GPU, the embedded model on a CPU)")
    parser.add_argument("--run-part", default=None, help=argparse.SUPPRESS)  # a function part's own process
    parser.add_argument("--part-limit", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.limit_scale > 0 or not args.budget > 0:
        parser.error("--budget and --limit-scale must be positive")
    source = args.model or (GPU_MODEL if args.device == "cuda" else None)
    model = ["--model", str(Path(source).resolve()) if Path(source).exists() else source] if source else []
    if args.run_part:
        return run_one_function_part(args, model)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here (--device cpu is the dry run)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        parser.error(f"{out} is not empty: give the runbook a new folder")

    started = time.time()
    end = started + args.budget
    summary: dict[str, Any] = dict(created=time.strftime("%Y-%m-%d %H:%M:%S"), command=sys.argv, budget=args.budget,
                                   machine=machine(args.device), parts=[])
    print(f"runbook: {', '.join(p.name for p in args.parts)} on {args.device}, budget {args.budget:.0f} s; "
          f"writing to {out}", flush=True)
    # Once, before the first part: since chapter 15 the package itself imports msgspec (the core's
    # messages), so every part needs what the wheels bring, not only the server's.
    summary["extra_packages"], extra_path = extra_packages(args.wheels, out / "wheels.log")
    print(f"packages: {summary['extra_packages']}", flush=True)
    for number, part in enumerate(args.parts, 1):
        own = (part.limit if args.device == "cuda" else part.cpu_limit or part.limit) * args.limit_scale
        limit = min(own, end - time.time())
        if limit < 5:
            row = dict(part=number, name=part.name, status="not run: the budget was spent", seconds=0, limit=0)
        else:
            print(f"part {number} {part.name} (limit {limit:.0f} s) ...", flush=True)
            run = Run(args.device, model, out, limit, time.time() + limit)
            row = run_part(part, number, run, extra_path)
        summary["parts"].append(row)
        summary["seconds"] = round(time.time() - started, 1)
        (out / "runbook.json").write_text(json.dumps(summary, indent=2, default=str, ensure_ascii=False) + "\n")
        if args.archive:
            pack(out, args.archive)
        print(f"  {row['status']} in {row['seconds']:.0f} s: "
              f"{json.dumps(row.get('summary', {}), default=str, ensure_ascii=False)}", flush=True)
        if row["status"] not in ("ok",) and "log" in row:
            tail = (out / row["log"]).read_text(errors="replace").splitlines()[-12:]
            print("  last lines of its log:\n    " + "\n    ".join(tail), flush=True)
    print(f"runbook done in {time.time() - started:.0f} s of {args.budget:.0f}: {out / 'runbook.json'}"
          + (f", packed into {args.archive}" if args.archive else ""), flush=True)
    return 0 if all(row["status"] == "ok" for row in summary["parts"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
