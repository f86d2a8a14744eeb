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
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from minivllm.request.messages import SpecDecodeStats
from minivllm.request.outputs import RequestOutput

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class _Clock:
    arrival_time: float
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

    def engine_state(self, running: int, waiting: int, kv_cache_usage: float, prefix_queried_tokens: int = 0,
                     prefix_hit_tokens: int = 0, spec: SpecDecodeStats | None = None) -> None:
        """The scheduler's and block manager's state; the prefix-cache totals are the block
        manager's running sums and `spec` the speculator's, which the counters follow."""
        v, m = self.vllm, self.model_name
        for mine, theirs, value in ((self.running, v.running, running), (self.waiting, v.waiting, waiting),
                                    (self.kv_cache_usage, v.kv_cache_usage, kv_cache_usage)):
            mine.set(value)
            theirs.labels(m).set(value)
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

    def request_started(self, request_id: str, arrival_time: float) -> None:
        self._clocks[request_id] = _Clock(arrival_time)

    def request_aborted(self, request_id: str) -> None:
        if self._clocks.pop(request_id, None) is not None:
            self.finished.labels("abort").inc()
            self.vllm.finished.labels(self.model_name, "abort").inc()

    def step_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Count and time one step's outputs (`now`: time.perf_counter() when they came out).
        Each request gives its histograms one sample; the counters move once per step, by the
        step's sums (a step with 128 streams would otherwise pay 128 label lookups per series)."""
        ttfts, gaps, e2es, reasons = [], [], [], []
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

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
