"""Chapter 17's lesson, measured online: decode streams' inter-token latency while long prompts
keep arriving, served by one engine or by a prefill and a decode instance behind `minivllm
disagg-proxy`.

The workload (`long_prompt_arrivals`): `streams` users, all sent at time 0, each stream a long
answer to a short prompt; meanwhile a long prompt arrives every `interval` seconds and asks for
a few tokens. In one engine each long prefill runs in a step beside the decodes, and that step's
time is a gap in every stream (chapter 5's stall). Disaggregated, the prefill runs in the other
instance; the decode instance loads the prompt's blocks and computes only its last tokens.

The servers are `minivllm serve` processes, prefix caching off. On a CPU they run the cheap
2-layer model (split_serving.CHEAP_SHAPE, one torch thread each: a decode step costs a few
milliseconds, as on a GPU); on a GPU, a real shape (a bare config.json: every process draws the
same random weights, so the blocks one computes are the ones the other would have). They are: one
plain engine; and twice a producer, a consumer and the proxy in front of them, the
blocks crossing once through files (SharedStorageConnector), once over ZMQ (ZmqConnector).
This process is the client: it sends every request as a stream at its planned time
(load.stream_completion) and takes each chunk's arrival time. TTFT and ITL are latency.py's, as
a user feels them: HTTP included and, disaggregated, the proxy's hop and the prefill instance's
round trip.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from minivllm.course.bench.latency import percentiles
from minivllm.course.bench.load import RequestResult, run_fast, stream_completion
from minivllm.course.bench.split_serving import ENGINE, free_port, running
from minivllm.kv_transfer.base import prefix_keys

BLOCK_SIZE = 16
MODEL_NAME = "cheap"


@dataclass(frozen=True)
class Planned:
    """One request of the workload: sent `at` seconds after the run starts."""

    at: float
    prompt: list[int]
    max_tokens: int
    kind: str  # "stream" (a short prompt, a long answer: whose ITL is measured) or "long" (a long prompt)


def long_prompt_arrivals(vocab_size: int, streams: int = 16, stream_prompt: int = 32, stream_tokens: int = 256,
                         long_prompts: int = 20, long_prompt: int = 480, long_tokens: int = 8,
                         interval: float = 0.1, first_long: float = 0.3, seed: int = 0) -> list[Planned]:
    """The workload: `streams` requests at time 0 (random prompts of `stream_prompt` token ids,
    `stream_tokens` output tokens each), then at most `long_prompts` requests of `long_prompt`
    tokens asking for `long_tokens` each, the first at `first_long` s and one every `interval` s
    after (replay sends them only while a stream runs). Sorted by arrival. Raises ValueError for a
    count or length below 1, or a negative time."""
    sizes = {"streams": streams, "stream_prompt": stream_prompt, "stream_tokens": stream_tokens,
             "long_prompts": long_prompts, "long_prompt": long_prompt, "long_tokens": long_tokens}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
    if interval < 0 or first_long < 0:
        raise ValueError(f"interval and first_long must be at least 0, got {interval!r} and {first_long!r}")
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    plan = [Planned(0.0, prompt(stream_prompt), stream_tokens, "stream") for _ in range(streams)]
    plan += [Planned(first_long + i * interval, prompt(long_prompt), long_tokens, "long") for i in range(long_prompts)]
    return sorted(plan, key=lambda p: p.at)


async def replay(url: str, plan: list[Planned], timeout: float = 120.0) -> tuple[list[RequestResult | None], float]:
    """Send each planned request as a stream to `url` at its time (one connection each), a long
    prompt only while some stream is still running: long prompts keep arriving as long as there
    are decodes to disturb, however slowly a loaded machine serves them. Returns the results in
    plan order (None: a long prompt not sent, every stream had ended) and the run's start
    (time.perf_counter())."""
    start = time.perf_counter()
    streams_left = sum(p.kind == "stream" for p in plan)
    streams_done = asyncio.Event()

    async def one(p: Planned) -> RequestResult | None:
        nonlocal streams_left
        delay = max(0.0, p.at - (time.perf_counter() - start))
        if p.kind == "long":
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(streams_done.wait(), delay)
            if streams_done.is_set():
                return None
        else:
            await asyncio.sleep(delay)
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=httpx.Timeout(timeout)) as client:
            result = await stream_completion(client, MODEL_NAME, p.prompt, p.max_tokens, timeout)
        if p.kind == "stream":
            streams_left -= 1
            if streams_left == 0:
                streams_done.set()
        return result

    return list(await asyncio.gather(*(one(p) for p in plan))), start


def itl_points(result: RequestResult, start: float) -> list[tuple[float, float]]:
    """(when, gap) for each of a request's inter-token gaps: when the later token arrived, in
    seconds after `start`, and the gap in seconds. A request with n token arrivals has n - 1."""
    times = result.token_times
    return [(later - start, later - earlier) for earlier, later in itertools.pairwise(times)]


def summarize(plan: list[Planned], results: list[RequestResult | None]) -> dict[str, Any]:
    """The streams' ITL and both kinds' TTFT at p50/p90/p99 and the mean (milliseconds), the
    requests sent (a None result was not) and those that failed (an error, or not exactly
    max_tokens tokens: load.stream_completion).
    An ITL is a gap between chunks, as load.py takes it: a server whose reader falls behind sends
    several steps' tokens in one chunk, so the streams' tokens and chunks are counted too."""
    if len(plan) != len(results):
        raise ValueError(f"{len(plan)} planned requests but {len(results)} results")
    sent = [(p, r) for p, r in zip(plan, results) if r is not None]
    done = [(p, r) for p, r in sent if r.ok]
    streams = [r for p, r in done if p.kind == "stream"]
    longs = [r for p, r in done if p.kind == "long"]
    summary: dict[str, Any] = {"requests": len(sent), "long_prompts_sent": sum(p.kind == "long" for p, _ in sent),
                               "failed": len(sent) - len(done), "errors": sorted({r.error for _, r in sent if r.error})[:5]}
    if streams:
        summary |= {"stream_tokens": sum(r.output_tokens for r in streams),
                    "stream_chunks": sum(len(r.token_times) for r in streams),
                    "stream_itl_ms": milliseconds([gap for r in streams for gap in r.itls]),
                    "stream_ttft_ms": milliseconds([r.ttft for r in streams])}
    if longs:
        summary["long_ttft_ms"] = milliseconds([r.ttft for r in longs])
    return summary


def milliseconds(seconds: list[float]) -> dict[str, float]:
    """latency.percentiles of some latencies, in milliseconds."""
    return {k: 1e3 * v for k, v in percentiles(seconds).items()}


def timelines(plan: list[Planned], results: list[RequestResult | None], start: float) -> dict[str, Any]:
    """What the ITL-over-time figure draws, in ms after the start (0.1 ms steps): each stream's
    token arrival times and each long prompt's arrival (those sent)."""
    return {"stream_token_ms": [[round(1e3 * (t - start), 1) for t in r.token_times]
                                for p, r in zip(plan, results) if p.kind == "stream"],
            "long_arrival_ms": [round(1e3 * p.at, 1) for p, r in zip(plan, results) if p.kind == "long" and r]}


# ---- the servers ----

def transfer_json(connector: str, role: str, where: Path | int) -> str:
    """--kv-transfer-config for `role`: SharedStorageConnector in folder `where`, or ZmqConnector
    on 127.0.0.1, port `where`."""
    extra = ({"shared_storage_path": str(where)} if connector == "SharedStorageConnector"
             else {"kv_host": "127.0.0.1", "kv_port": where})
    return json.dumps({"kv_connector": connector, "kv_role": role, "kv_connector_extra_config": extra})


def serve_command(model: Path, port: int, device: str, dtype: str | None, *extra: str) -> list[str]:
    """`minivllm serve` of one instance; on a CPU, one torch thread (the instances share the cores)."""
    placement = ["--device", device, *(["--dtype", dtype] if dtype else []), *(["--threads", "1"] if device == "cpu" else [])]
    return ["serve", "--model", str(model), "--served-model-name", MODEL_NAME, "--port", str(port), *placement,
            "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--num-kv-blocks", str(ENGINE["num_kv_blocks"]), "--no-enable-prefix-caching", *extra]


SETUPS = ("one engine", "disaggregated, files", "disaggregated, ZMQ")


def all_setups(model: Path, folder: Path, device: str = "cpu",
               dtype: str | None = None) -> tuple[list[tuple[str, list[str], str]], dict[str, str]]:
    """The servers of every setup (for `running`) and the url each setup (SETUPS) is sent to:
    one `minivllm serve`; and twice a producer and a consumer with `minivllm disagg-proxy` in
    front of them (up once the consumer is: it answers /v1/models by asking it), their blocks
    crossing through files in `folder` (SharedStorageConnector) or over ZMQ (ZmqConnector)."""
    local = "http://127.0.0.1:{}".format
    engine = free_port()
    servers = [("the engine", serve_command(model, engine, device, dtype), local(engine) + "/health")]
    urls = {SETUPS[0]: local(engine)}
    for setup, connector in zip(SETUPS[1:], ("SharedStorageConnector", "ZmqConnector")):
        prefill, decode, proxy = free_port(), free_port(), free_port()
        where = folder if connector == "SharedStorageConnector" else free_port()
        for port, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
            command = serve_command(model, port, device, dtype, "--kv-transfer-config",
                                    transfer_json(connector, role, where))
            servers.append((f"{setup}: the {role}", command, local(port) + "/health"))
        servers.append((f"{setup}: the proxy", ["disagg-proxy", "--prefill", local(prefill), "--decode",
                                                local(decode), "--port", str(proxy)], local(proxy) + "/v1/models"))
        urls[setup] = local(proxy)
    return servers, urls


def measure(model: Path, vocab_size: int, rounds: int = 3, seed: int = 0, progress=print, device: str = "cpu",
            dtype: str | None = None, **workload: Any) -> dict[str, Any]:
    """Every setup (SETUPS) on the same requests, every instance on `device` ("cpu" or "cuda",
    in `dtype`: None is the device's default; on a GPU all five processes share it), in turns
    round by round (the order rotating: the machine is shared), each round on fresh prompts
    (seed + round). Servers start once and
    stay up. Returns per setup: every round's summary and load average, the median over rounds of
    each percentile, and the timelines of the round whose stream ITL p99 is the median; and the
    block files the files setup's producer wrote against the full blocks of every prompt it was
    sent (warm-up included), with the prompts some of whose blocks no file holds (the consumer
    computed those)."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer of at least 1, got {rounds!r}")
    if device not in ("cpu", "cuda") or dtype not in (None, "float32", "bfloat16", "float16"):
        raise ValueError(f"device must be 'cpu' or 'cuda' and dtype None, 'float32', 'bfloat16' or 'float16', "
                         f"got {device!r} and {dtype!r}")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETUPS}
    small = {"streams": 2, "stream_tokens": 8, "long_prompts": 2, "first_long": 0.0, "interval": 0.0}
    warm = long_prompt_arrivals(vocab_size, **(workload | small), seed=seed + rounds)  # a seed no round uses
    sent: list[Planned] = []  # what the producer was sent
    with tempfile.TemporaryDirectory(prefix="minivllm-kv-") as folder:
        servers, urls = all_setups(model, Path(folder), device, dtype)
        with running(servers):
            warm_up_failed = 0
            for name, url in urls.items():  # first requests pay one-time costs: not measured
                results = run_fast(replay(url, warm))[0]
                warm_up_failed += summarize(warm, results)["failed"]
                sent += [p for p, r in zip(warm, results) if r is not None and name == "disaggregated, files"]
            for round_ in range(rounds):
                plan = long_prompt_arrivals(vocab_size, seed=seed + round_, **workload)
                for name in SETUPS[round_ % len(SETUPS):] + SETUPS[:round_ % len(SETUPS)]:
                    load = os.getloadavg()
                    results, start = run_fast(replay(urls[name], plan))
                    run = summarize(plan, results) | {"round": round_, "load_average": list(load),
                                                      "timelines": timelines(plan, results, start)}
                    runs[name].append(run)
                    sent += [p for p, r in zip(plan, results) if r is not None and name == "disaggregated, files"]
                    itl = run.get("stream_itl_ms", {})
                    progress(f"round {round_} {name}: stream ITL p50 {itl.get('p50', float('nan')):.1f} ms, "
                             f"p99 {itl.get('p99', float('nan')):.1f} ms, {run['long_prompts_sent']} long prompts, "
                             f"failed {run['failed']} (load {load[0]:.1f})")
        saved = {path.stem for path in Path(folder).rglob("*.safetensors")}
    unsaved = [(p.kind, sum(key not in saved for key in prefix_keys(p.prompt, BLOCK_SIZE))) for p in sent]
    out: dict[str, Any] = {"block_files": len(saved),
                           "expected_block_files": sum(len(p.prompt) // BLOCK_SIZE for p in sent),
                           "prompts_with_unsaved_blocks": [{"kind": kind, "blocks": n} for kind, n in unsaved if n],
                           "warm_up_failed": warm_up_failed, "setups": {}}
    for name, rs in runs.items():
        out["setups"][name] = {"medians": median_summary(rs), "median_round": median_round(rs),
                               "rounds": [{k: v for k, v in r.items() if k != "timelines"} for r in rs]}
    return out


def median_summary(rounds: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each measure's percentiles, the median over rounds (rounds missing a measure left out)."""
    keys = ("stream_itl_ms", "stream_ttft_ms", "long_ttft_ms")
    return {key: {p: statistics.median(r[key][p] for r in rounds if key in r) for p in ("p50", "p90", "p99", "mean")}
            for key in keys if any(key in r for r in rounds)}


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose stream ITL p99 is the median (the lower middle one of an even count): its
    number, load average and timelines."""
    ordered = sorted(rounds, key=lambda r: r.get("stream_itl_ms", {}).get("p99", float("inf")))
    chosen = ordered[(len(ordered) - 1) // 2]
    return {"round": chosen["round"], "load_average": chosen["load_average"], **chosen["timelines"]}
