"""What GET /metrics reports, in Prometheus' text format (chapter 10).

The same quantities vLLM exports, under `minivllm_` names: how many requests run and wait,
how full the KV cache is, how many prompt tokens the prefix cache (chapter 11) was asked for and
found, how many guesses speculative decoding (chapter 12) made and kept, prompt and generated
tokens, and the latencies a user feels as
histograms. Each histogram has a bucket edge at the chapter's SLO (500 ms to the first token,
20 ms between tokens = 50 tokens/s), so `le="0.5"` reads directly as "how many met it".

All updates come from the engine thread, at the moment a step's outputs come out (or a request
is taken in or aborted); the event loop only reads. prometheus_client's metrics are
thread-safe, and the per-request clocks below are touched by the engine thread alone.

Issue 36: every quantity vLLM also exports is exported a second time under vLLM's name
(`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`, ..., labelled with
`model_name` as vLLM's are), so a Grafana dashboard made for vLLM reads this server unchanged.
Issue 49 adds the series vLLM has and the `minivllm_` names never had, under vLLM's names only,
with vLLM's types, labels and bucket edges: tokens per step, waiting by reason, preemptions,
the cache's configuration, and per finished request its sizes and where its time went:

    arrival ── queue ──► first scheduled ── prefill ──► first token ── decode ──► last token
                         └─────────────────────── inference ──────────────────────┘

(queue + inference = e2e latency). The token edges of those histograms reach the context
length, which a core process knows only once it has started: `describe_engine` makes them then.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from minivllm.request.messages import SpecDecodeStats
from minivllm.request.outputs import RequestOutput
from minivllm.request.sampling_params import SamplingParams

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# vLLM's edges (vllm/v1/metrics/loggers.py): tokens per step, the n parameter, a request's phases.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's edges for a request's token counts."""
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return edges
            edges.append(mantissa * scale)
        scale *= 10


@dataclass
class _Clock:
    arrival_time: float
    max_tokens: int | None = None  # the request's parameter (None: up to the context)
    last_token_time: float = 0.0
    num_tokens: int = 0  # output tokens seen so far, all completions together


class VllmNames:
    """The same quantities under vLLM's names, labelled by model (vLLM's label)."""

    def __init__(self, r: CollectorRegistry) -> None:
        label = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", label, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued, not yet running", label, registry=r)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the KV-cache blocks in use (0-1)", label,
                                    registry=r)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                            "cache", label, registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", label,
                                         registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests that started", label, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Output tokens generated", label, registry=r)
        self.finished = Counter("vllm:request_success", "Requests done, by why they ended",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first output token", label,
                              buckets=TTFT_BUCKETS, registry=r)
        # vLLM exports the time between output steps under both names (the older one kept for dashboards)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's output steps", label,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time between a request's output steps", label,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last output token", label,
                             buckets=E2E_BUCKETS, registry=r)
        # Issue 49. "deferred": a grammar still compiling (chapter 13), the only wait here that is not
        # for room; "capacity": a place in the batch or KV blocks. The two add up to num_requests_waiting.
        self.waiting_by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Waiting requests by why they wait: "
                                       "capacity (room in the batch or the KV cache) or deferred (a grammar still "
                                       "compiling)", ["model_name", "reason"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted: their KV cache freed, to be "
                                   "recomputed", label, registry=r)
        # As vLLM counts a step's tokens: the prompts of the requests whose first token it made, and its new tokens.
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Prompt and output tokens per engine step",
                                          label, buckets=ITERATION_TOKEN_BUCKETS, registry=r)


class RequestHistograms:
    """vLLM's per-request histograms: one sample per finished request (aborted ones give none, as
    in vLLM). Token edges reach max_model_len. The times are perf_counter() readings of the server
    (arrival, last token) and of the core (first scheduled, first token): one clock, system-wide."""

    def __init__(self, r: CollectorRegistry, max_model_len: int) -> None:
        label, tokens = ["model_name"], one_two_five(max_model_len)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens of a finished request", label,
                                       buckets=tokens, registry=r)
        self.generation_tokens = Histogram("vllm:request_generation_tokens", "Output tokens of a finished request "
                                           "(its n completions together)", label, buckets=tokens, registry=r)
        self.n = Histogram("vllm:request_params_n", "The n request parameter", label, buckets=N_BUCKETS, registry=r)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens request parameter", label,
                                    buckets=tokens, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to the first step that ran the request",
                               label, buckets=PHASE_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first output token", label,
                                 buckets=PHASE_BUCKETS, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "First output token to last", label,
                                buckets=PHASE_BUCKETS, registry=r)
        self.inference = Histogram("vllm:request_inference_time_seconds", "First scheduled to last output token",
                                   label, buckets=PHASE_BUCKETS, registry=r)

    def observe(self, model_name: str, output: RequestOutput, clock: _Clock, now: float) -> None:
        """A request that finished at `now`, with `clock.num_tokens` output tokens."""
        m = model_name
        self.prompt_tokens.labels(m).observe(len(output.prompt_token_ids))
        self.generation_tokens.labels(m).observe(clock.num_tokens)
        self.n.labels(m).observe(len(output.outputs))
        if clock.max_tokens is not None:
            self.max_tokens.labels(m).observe(clock.max_tokens)
        times = output.metrics
        if times is None or times.first_scheduled_time is None or times.first_token_time is None:
            return
        scheduled, first = times.first_scheduled_time, times.first_token_time
        for histogram, seconds in ((self.queue, scheduled - clock.arrival_time), (self.prefill, first - scheduled),
                                   (self.decode, now - first), (self.inference, now - scheduled)):
            histogram.labels(m).observe(seconds)


class ServerMetrics:
    """One registry per server, so that several servers (tests) in one process stay apart.
    model_name labels the vllm: series (the server sets it to the name it serves)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.model_name = "minivllm"
        r = self.registry
        self.vllm = VllmNames(r)
        self.running = Gauge("minivllm_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("minivllm_num_requests_waiting", "Requests queued, not yet running", registry=r)
        self.kv_cache_usage = Gauge("minivllm_kv_cache_usage", "Fraction of the KV-cache blocks in use (0-1)",
                                    registry=r)
        # Prompt tokens looked up in the prefix cache and found there: hits / queries is the hit rate.
        self.prefix_cache_queries = Counter("minivllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter("minivllm_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                         registry=r)
        self._prefix_seen = (0, 0)  # the block manager's (queried, hit) totals at the last update
        # Speculative decoding (chapter 12), vLLM's counters: a draft is one sequence's guesses in one step.
        self.spec_drafts = Counter("minivllm_spec_decode_num_drafts", "Drafts verified", registry=r)
        self.spec_draft_tokens = Counter("minivllm_spec_decode_num_draft_tokens", "Guessed tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("minivllm_spec_decode_num_accepted_tokens", "Guessed tokens accepted",
                                            registry=r)
        self.spec_accepted_per_position = Counter("minivllm_spec_decode_num_accepted_tokens_per_pos",
                                                  "Accepted guesses by their position in the draft", ["position"],
                                                  registry=r)
        self._spec_seen: SpecDecodeStats | None = None  # the engine's totals at the last update
        self.prompt_tokens = Counter("minivllm_prompt_tokens", "Prompt tokens of requests that started", registry=r)
        self.generation_tokens = Counter("minivllm_generation_tokens", "Output tokens generated", registry=r)
        self.finished = Counter("minivllm_requests_finished", "Requests done, by why they ended",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("minivllm_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("minivllm_inter_token_latency_seconds", "Time between a request's output steps",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("minivllm_e2e_request_latency_seconds", "Arrival to last output token",
                             buckets=E2E_BUCKETS, registry=r)
        self._clocks: dict[str, _Clock] = {}
        self.requests: RequestHistograms | None = None  # made by describe_engine
        self._preemptions_seen = 0  # the scheduler's total at the last update

    def describe_engine(self, info: dict[str, Any]) -> None:
        """What the engine is (EngineCore.info(): its context, its KV cache), once it has started:
        vLLM's cache_config_info (a gauge at 1 whose labels are the facts) and the per-request
        histograms, whose token edges reach max_model_len; the new scheduler series start at 0, as
        vLLM's do, so a dashboard sees them before the first step. A second call changes nothing."""
        if self.requests is not None:
            return
        self.requests = RequestHistograms(self.registry, info["max_model_len"])
        for reason in ("capacity", "deferred"):
            self.vllm.waiting_by_reason.labels(self.model_name, reason).set(0)
        self.vllm.preemptions.labels(self.model_name).inc(0)
        cache = {"block_size": str(info["block_size"]), "num_gpu_blocks": str(info["num_kv_blocks"]),
                 "enable_prefix_caching": str(bool(info.get("enable_prefix_caching"))),
                 "cache_dtype": str(info.get("environment", {}).get("dtype", "auto"))}
        Gauge("vllm:cache_config_info", "The KV cache's configuration, as labels (num_gpu_blocks: blocks in the "
              "pool, on whatever device)", list(cache), registry=self.registry).labels(**cache).set(1)

    def engine_state(self, running: int, waiting: int, kv_cache_usage: float, prefix_queried_tokens: int = 0,
                     prefix_hit_tokens: int = 0, spec: SpecDecodeStats | None = None, num_preemptions: int = 0,
                     waiting_deferred: int = 0) -> None:
        """The scheduler's and block manager's state; the prefix-cache totals are the block
        manager's running sums, `spec` the speculator's and num_preemptions the scheduler's,
        which the counters follow. waiting_deferred: of `waiting`, those waiting for a grammar."""
        v, m = self.vllm, self.model_name
        for mine, theirs, value in ((self.running, v.running, running), (self.waiting, v.waiting, waiting),
                                    (self.kv_cache_usage, v.kv_cache_usage, kv_cache_usage)):
            mine.set(value)
            theirs.labels(m).set(value)
        v.waiting_by_reason.labels(m, "capacity").set(waiting - waiting_deferred)
        v.waiting_by_reason.labels(m, "deferred").set(waiting_deferred)
        v.preemptions.labels(m).inc(num_preemptions - self._preemptions_seen)
        self._preemptions_seen = num_preemptions
        queried, hit = self._prefix_seen
        for mine, theirs, new in ((self.prefix_cache_queries, v.prefix_cache_queries, prefix_queried_tokens - queried),
                                  (self.prefix_cache_hits, v.prefix_cache_hits, prefix_hit_tokens - hit)):
            mine.inc(new)
            theirs.labels(m).inc(new)
        self._prefix_seen = (prefix_queried_tokens, prefix_hit_tokens)
        if spec is not None:
            seen = self._spec_seen or SpecDecodeStats(spec.k)
            self.spec_drafts.inc(spec.num_drafts - seen.num_drafts)
            self.spec_draft_tokens.inc(spec.num_draft_tokens - seen.num_draft_tokens)
            self.spec_accepted_tokens.inc(spec.num_accepted_tokens - seen.num_accepted_tokens)
            for j, (now, then) in enumerate(zip(spec.num_accepted_per_position, seen.num_accepted_per_position)):
                self.spec_accepted_per_position.labels(str(j)).inc(now - then)
            self._spec_seen = dataclasses.replace(spec, num_drafts_per_position=list(spec.num_drafts_per_position),
                                                  num_accepted_per_position=list(spec.num_accepted_per_position))

    def request_started(self, request_id: str, arrival_time: float, params: SamplingParams | None = None) -> None:
        self._clocks[request_id] = _Clock(arrival_time, None if params is None else params.max_tokens)

    def request_aborted(self, request_id: str) -> None:
        if self._clocks.pop(request_id, None) is not None:
            self.finished.labels("abort").inc()
            self.vllm.finished.labels(self.model_name, "abort").inc()

    def step_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Count and time one step's outputs (`now`: time.perf_counter() when they came out).
        Each request gives its histograms one sample; the counters move once per step, by the
        step's sums (a step with 128 streams would otherwise pay 128 label lookups per series)."""
        ttfts, gaps, e2es, reasons, finished = [], [], [], [], []
        prompt_tokens = new_tokens = 0
        for output in outputs:
            clock = self._clocks.get(output.request_id)
            if clock is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if num_tokens > clock.num_tokens:
                if clock.num_tokens == 0:
                    ttfts.append(now - clock.arrival_time)
                    prompt_tokens += len(output.prompt_token_ids)
                else:
                    gaps.append(now - clock.last_token_time)
                new_tokens += num_tokens - clock.num_tokens
                clock.num_tokens, clock.last_token_time = num_tokens, now
            if output.finished:
                e2es.append(now - clock.arrival_time)
                reasons.append(output.outputs[0].finish_reason or "unknown")
                finished.append((output, clock))
                del self._clocks[output.request_id]
        v, m = self.vllm, self.model_name
        for samples, histograms in ((ttfts, lambda: (self.ttft, v.ttft.labels(m))),
                                    (gaps, lambda: (self.itl, v.itl.labels(m), v.tpot.labels(m))),
                                    (e2es, lambda: (self.e2e, v.e2e.labels(m)))):
            if samples:
                for histogram in histograms():
                    for sample in samples:
                        histogram.observe(sample)
        for mine, theirs, count in ((self.prompt_tokens, v.prompt_tokens, prompt_tokens),
                                    (self.generation_tokens, v.generation_tokens, new_tokens)):
            if count:
                mine.inc(count)
                theirs.labels(m).inc(count)
        for reason in reasons:
            self.finished.labels(reason).inc()
            v.finished.labels(m, reason).inc()
        if prompt_tokens or new_tokens:
            v.iteration_tokens.labels(m).observe(prompt_tokens + new_tokens)
        if self.requests is not None:
            for output, clock in finished:
                self.requests.observe(m, output, clock, now)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format; with several API servers, all of them."""
        folder = os.environ.get(MULTIPROCESS_FOLDER)
        return generate_latest(AllAPIServers(self.registry, folder) if folder else self.registry)


# ---- issue 48: one /metrics over N API server processes ----

MULTIPROCESS_FOLDER = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it once, when first imported


class AllAPIServers:
    """What /metrics shows when `minivllm serve --api-server-count N` runs N API server processes
    (their parent sets MULTIPROCESS_FOLDER for them, so that prometheus_client keeps every value
    in a memory-mapped file per process there).

    Two kinds of series, two answers. What the frontends count (requests, tokens, the latency
    histograms) is spread over the processes, each counting its own requests: prometheus_client's
    multiprocess collector adds up the files of all of them, the dead included. The gauges are
    the core's (running, waiting, KV use): every API server gets them with every step, so this
    process's own values already describe the whole core. (Multiprocess mode would need a mode
    chosen per gauge; its default gives one series per pid, which is not one view.) The counters
    that follow the core's running sums (prefix cache, speculation) are counted by API server 0
    alone: the core sends the sums to it only (core/process.py)."""

    def __init__(self, own: CollectorRegistry, folder: str):
        self.own, self.folder = own, folder

    def collect(self) -> Iterator[Metric]:
        for family in MultiProcessCollector(None, self.folder).collect():
            if family.type != "gauge":
                yield family
        for family in self.own.collect():
            if family.type == "gauge":
                yield family
