"""A load generator for the server, in the spirit of vLLM's serving benchmark (chapter 10).

Many simulated users stream completions at once, the way an OpenAI client would, and every
token's arrival time is taken on the client side: what a user feels, HTTP included.

- Fixed concurrency (`--concurrency 1,8,32,128`): C users, each sending its next request the
  moment its previous answer ends (a closed loop: the load is the number of people).
- Fixed rate (`--rate 2,8`): requests arrive as a Poisson process, whether or not earlier
  ones are done (an open loop: the load is the traffic).

Per level it reports TTFT (send -> first token), TPOT ((last - first token) / (tokens - 1)),
ITL (every gap between chunks) and end-to-end latency at p50/p90/p99, request and token
throughput, and goodput: the requests per second that met the SLO (by default TTFT < 500 ms
and at least 50 tokens/s for that user, i.e. TPOT <= 20 ms). "The SLO holds" at a level when
the p99 of both does: 99 users in 100 are served that well.

The prompts are random token ids of the standard workloads (`minivllm.course.bench.WORKLOADS`) with
EOS ignored, so every request generates exactly its planned number of tokens. Everything is
bounded: a number of requests per level, a timeout per request and a deadline per level;
requests that fail or run out of time are counted, never dropped silently.

The chapter's measurement, with both policies measured level by level side by side:

    minivllm serve --threads 1 --port 8000 &
    minivllm serve --threads 1 --port 8001 --scheduler static --static-batch-size 16 &
    minivllm bench-serve --url http://127.0.0.1:8000,http://127.0.0.1:8001 --concurrency 1,8,32,128

and on a GPU, with the Qwen3-0.6B shape (random weights, prompts as token ids) and a KV pool
set by hand so that two servers share the GPU evenly (16,384 blocks of 16 tokens = 28 GiB
each, room for 128 requests of 2,048 tokens):

    minivllm serve --model minivllm/configs/qwen3-0.6b.json --num-kv-blocks 16384 --port 8000 &
    minivllm serve --model minivllm/configs/qwen3-0.6b.json --num-kv-blocks 16384 --port 8001 \\
        --scheduler static --static-batch-size 16 &
    minivllm bench-serve --url http://127.0.0.1:8000,http://127.0.0.1:8001 --concurrency 1,8,32,128 --workload nano
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import ssl
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from rich.console import Console
from rich.table import Table

from minivllm.course.bench.harness import RESULTS_DIR, save_results
from minivllm.course.bench.latency import Latencies, latency_percentiles
from minivllm.course.bench.workloads import Workload, make_workload
from minivllm.course.plots import save
from minivllm.course.plots.serving import plot_serving

console = Console()
T = TypeVar("T")


@dataclass(frozen=True)
class SLO:
    ttft: float = 0.5  # seconds to the first token
    tokens_per_second: float = 50.0  # per user, after the first token

    @property
    def tpot(self) -> float:
        return 1 / self.tokens_per_second

    def met_by(self, result: RequestResult) -> bool:
        return result.ok and result.ttft < self.ttft and (result.tpot is None or result.tpot <= self.tpot)


@dataclass
class RequestResult(Latencies):
    planned_tokens: int
    start: float = 0.0  # time.perf_counter() when sent
    token_times: list[float] = field(default_factory=list)  # when each chunk of tokens arrived
    output_tokens: int = 0  # as the server's usage chunk counts them
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def num_tokens_received(self) -> int:
        return self.output_tokens  # a chunk holds every token one engine step gave the request


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int,
                            timeout: float) -> RequestResult:
    """One streamed /v1/completions request, timed chunk by chunk (at most `timeout` seconds)."""
    result = RequestResult(max_tokens, start=time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    async def receive() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return
            async for line in response.aiter_lines():
                data = line.removeprefix("data: ")
                if data == line or data == "[DONE]":  # blank separator lines, or the end
                    continue
                chunk = json.loads(data)
                if chunk.get("error"):  # the server failed after the stream began: it says why
                    result.error = f"server error: {chunk['error'].get('message')}"
                    return
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk["choices"]:  # one chunk per engine step that gave this request tokens
                    result.token_times.append(time.perf_counter())

    try:
        await asyncio.wait_for(receive(), timeout)
    except (httpx.HTTPError, asyncio.TimeoutError) as err:
        result.error = f"{type(err).__name__}: {err}"
    if result.error is None and result.output_tokens != max_tokens:
        result.error = f"expected {max_tokens} tokens, the server reported {result.output_tokens}"
    return result


async def run_level(url: str, model: str, workload: Workload, concurrency: int | None = None,
                    rate: float | None = None, timeout: float = 300.0, deadline: float = 900.0) -> tuple[list[RequestResult], float]:
    """Send every request of the workload with `concurrency` users in a closed loop, or at
    the workload's Poisson arrival times (`rate`). Returns the results and the wall time."""
    requests = list(zip(workload.prompts, workload.output_lens))
    results: list[RequestResult] = []
    tls = ssl.create_default_context()  # made once: each client would otherwise read the CA store again

    def one_connection() -> httpx.AsyncClient:
        # A client per user (closed loop) or per request (open loop), each with one connection:
        # httpx's pool scans all of its connections for every request, which at 128 users cost
        # this process more than reading the streams did (and made the client the bottleneck).
        return httpx.AsyncClient(base_url=url, trust_env=False, timeout=httpx.Timeout(timeout), verify=tls,
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))

    async def user(queue: list[tuple[list[int], int]]) -> None:  # closed loop: next request when one ends
        async with one_connection() as client:
            while queue:
                prompt, n = queue.pop()
                results.append(await stream_completion(client, model, prompt, n, timeout))

    async def arrival(at: float, prompt: list[int], n: int) -> None:  # open loop: on schedule
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
        async with one_connection() as client:
            results.append(await stream_completion(client, model, prompt, n, timeout))

    start = time.perf_counter()
    if rate is None:
        queue = requests[::-1]
        tasks = [asyncio.ensure_future(user(queue)) for _ in range(concurrency)]
    else:
        tasks = [asyncio.ensure_future(arrival(at, p, n)) for at, (p, n) in zip(workload.arrivals, requests)]
    done, pending = await asyncio.wait(tasks, timeout=deadline)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.perf_counter() - start
    missing = len(requests) - len(results)
    results += [RequestResult(0, error=f"not finished within the {deadline:g} s deadline") for _ in range(missing)]
    return results, elapsed


def run_fast(work: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, on uvloop where it is installed (uvicorn[standard] brings it): the load
    generator's own event loop must cost less than the server it measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(work)
    return uvloop.run(work)


def summarize(results: list[RequestResult], elapsed: float, slo: SLO) -> dict[str, Any]:
    """Percentiles of TTFT, TPOT, ITL and E2E (seconds), throughputs, goodput and whether the
    SLO held at p99."""
    ok = [r for r in results if r.ok]
    summary: dict[str, Any] = latency_percentiles(ok)
    good = sum(slo.met_by(r) for r in results)
    summary |= {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5], "seconds": elapsed,
        "request_throughput": len(ok) / elapsed, "output_throughput": sum(r.output_tokens for r in ok) / elapsed,
        "goodput": good / elapsed, "slo_fraction": good / len(results),
    }
    p99_ttft = summary.get("ttft", {}).get("p99", math.inf)
    p99_tpot = summary.get("tpot", {}).get("p99", 0.0)
    summary["slo_met"] = not summary["failed"] and p99_ttft < slo.ttft and p99_tpot <= slo.tpot
    return summary


def highest_level_meeting_slo(levels: Sequence[dict[str, Any]], key: str) -> float | None:
    """The largest concurrency (or rate) at which the SLO held, None if it never did."""
    met = [level[key] for level in levels if level["slo_met"]]
    return max(met) if met else None


async def server_info(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as client:
        response = await client.get("/server_info")
        response.raise_for_status()
        return response.json()


async def warm_up(url: str, model: str, vocab_size: int) -> None:
    """Two short requests, so that the first measured one does not pay for first-call costs."""
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=60) as client:
        for _ in range(2):
            await stream_completion(client, model, list(range(min(8, vocab_size))), 4, 60)


def clip_to_context(workload: Workload, max_model_len: int) -> Workload:
    """Output lengths that fit the server's context (prompt + output <= max_model_len)."""
    lens = [min(n, max_model_len - len(p)) for p, n in zip(workload.prompts, workload.output_lens)]
    return Workload(workload.name, workload.prompts, lens, workload.arrivals)


def bench_serve(urls: Sequence[str], concurrency: Sequence[int] | None = None, rates: Sequence[float] | None = None,
                workload: str = "classroom", requests: int | Sequence[int] | None = None, seed: int = 0, slo: SLO = SLO(),
                labels: Sequence[str] | None = None, results: str | None = None, figure: str | None = None,
                timeout: float = 300.0, deadline: float = 900.0) -> dict[str, Any]:
    """Measure one or more servers at every level, print a table per server, merge each run
    into benchmarks/results/<results>.json (under its label, by default the server's
    scheduler: "continuous", "static") and redraw the figure from every run that file holds.

    With several servers (say a continuous and a static one, both started beforehand), each
    level runs on every server before the next level starts: on a shared machine whose load
    drifts, the servers are compared side by side rather than minutes apart. A server that is
    not being measured sits idle (its engine thread waits on its inbox). `requests`: per level,
    one count for all or one per level (default: max(32, 4 × users), or max(32, 16 × rate)).
    Returns the file's content."""
    if (concurrency is None) == (rates is None):
        raise ValueError("give either concurrency levels or request rates")
    levels_given = list(concurrency if concurrency is not None else rates)
    counts = list(requests) if isinstance(requests, Sequence) else [requests] * len(levels_given)
    if len(counts) != len(levels_given) or any(n is not None and (isinstance(n, bool) or not isinstance(n, int)
                                                                  or n < 1) for n in counts):
        raise ValueError(f"requests must be None, an int >= 1 or one such int per level ({len(levels_given)}), "
                         f"got {requests!r}")
    for value in concurrency or rates:
        if not value > 0:
            raise ValueError(f"concurrency levels and rates must be > 0, got {value!r}")
    infos = [asyncio.run(server_info(url)) for url in urls]
    labels = list(labels) if labels else [info["scheduler"] for info in infos]
    if len(labels) != len(urls) or len(set(labels)) != len(labels):
        raise ValueError(f"need one distinct label per server, got {labels} for {len(urls)} server(s)")
    gpu = not infos[0]["environment"]["device"].startswith("cpu")
    x_key, xs = ("concurrency", list(concurrency)) if concurrency is not None else ("rate", list(rates))
    results = results or f"10_serving_{'gpu' if gpu else 'cpu'}"
    figure = figure or f"10_latency_vs_{x_key}" + ("_gpu" if gpu else "")
    for url, info, label in zip(urls, infos, labels):
        console.print(f"[bold]{label}[/] {url}: {describe_server(info)}")
        asyncio.run(warm_up(url, info["model"], info["vocab_size"]))

    levels: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for x, count in zip(xs, counts):
        n = count or (max(32, 4 * x) if x_key == "concurrency" else max(32, math.ceil(16 * x)))
        for url, info, label in zip(urls, infos, labels):
            work = make_workload(workload, info["vocab_size"], seed=seed, num_requests=n,
                                 rate=x if x_key == "rate" else None)
            work = clip_to_context(work, info["max_model_len"])
            console.print(f"{label}: {x_key} {x:g}, {work.describe()}")
            load = os.getloadavg()[0]  # the machine's 1-minute load when the level started (shared machines drift)
            outcome, elapsed = run_fast(run_level(url, info["model"], work,
                                                     concurrency=x if x_key == "concurrency" else None,
                                                     rate=x if x_key == "rate" else None, timeout=timeout,
                                                     deadline=deadline))
            levels[label].append({x_key: x, "load_average": load} | summarize(outcome, elapsed, slo))

    path = RESULTS_DIR / f"{results}.json"
    payload = json.loads(path.read_text()) if path.exists() else {}
    payload.setdefault("benchmark", "serving over HTTP (minivllm bench-serve)")
    for info, label in zip(infos, labels):
        console.print(levels_table(label, levels[label], x_key, slo, describe_server(info)))
        best = highest_level_meeting_slo(levels[label], x_key)
        console.print(f"[bold]{label}[/]: the SLO (p99 TTFT < {slo.ttft * 1e3:g} ms and >= {slo.tokens_per_second:g} "
                      f"tok/s per user) holds up to {x_key} {best if best is not None else 'none of the levels'}")
        payload.setdefault("runs", {}).setdefault(x_key, {})[label] = {
            "server": info, "workload": workload, "seed": seed, "interleaved_with": [lb for lb in labels if lb != label],
            "slo": {"ttft": slo.ttft, "tokens_per_second": slo.tokens_per_second}, "timeout": timeout,
            "deadline": deadline, "highest_level_meeting_slo": best, "levels": levels[label],
        }
    save_results(results, payload)
    runs = {name: run["levels"] for name, run in payload["runs"][x_key].items()}
    fig = plot_serving(runs, x_key, slo.ttft, slo.tokens_per_second,
                       subtitle=f"{describe_machine(infos[0])}; workload {workload} (EOS ignored)")
    console.print(f"wrote {path} and {save(fig, figure)}")
    return payload


def describe_machine(info: dict[str, Any]) -> str:
    """Device, dtype and model shape of a server (from its /server_info)."""
    env, shape = info["environment"], info["environment"].get("model", {})
    return (f"{env.get('device')}, {env.get('dtype')}, {shape.get('model_type')} {shape.get('parameters', 0) / 1e6:.1f}M "
            f"params ({shape.get('num_layers')} layers, hidden {shape.get('hidden_size')})")


def describe_server(info: dict[str, Any]) -> str:
    batches = f" (batches of {info['static_batch_size']})" if info["static_batch_size"] else ""
    return f"{info['scheduler']} scheduler{batches}, {describe_machine(info)}"


def levels_table(label: str, levels: list[dict[str, Any]], x_key: str, slo: SLO, server: str) -> Table:
    table = Table(title=f"{label}: {server}")
    columns = (x_key, "done", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms", "tok/s per user p50 / slowest 1%",
               "output tok/s", "goodput req/s", f"SLO met ({slo.ttft * 1e3:g} ms, {slo.tokens_per_second:g} tok/s)")
    for column in columns:
        table.add_column(column, justify="right")
    for lv in levels:
        ttft, tpot = lv.get("ttft"), lv.get("tpot")
        table.add_row(
            f"{lv[x_key]:g}", f"{lv['completed']}/{lv['requests']}",
            f"{ttft['p50'] * 1e3:,.0f} / {ttft['p99'] * 1e3:,.0f}" if ttft else "—",
            f"{tpot['p50'] * 1e3:,.1f} / {tpot['p99'] * 1e3:,.1f}" if tpot else "—",
            f"{1 / tpot['p50']:,.0f} / {1 / tpot['p99']:,.0f}" if tpot else "—",
            f"{lv['output_throughput']:,.0f}", f"{lv['goodput']:.2f} ({lv['slo_fraction']:.0%})",
            "[green]yes[/]" if lv["slo_met"] else "[red]no[/]",
        )
    return table
