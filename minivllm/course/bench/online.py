"""Serving requests that arrive over time (chapter 7): continuous vs static batching under the
same Poisson arrivals, and the latencies a user would feel.

Both policies run on the same engine (same model, same paged attention), so the only
difference is *when requests may join and leave*:

- continuous: a request is added the moment it arrives and joins the very next step;
- static: when the server is free it takes the requests that have arrived (up to
  `batch_size`) and runs them as one batch until its longest request is done; later arrivals
  wait for the whole batch. Shorter rows keep computing (padding work) to the batch's end.

Time is simulated but every step is real: the clock advances by each step's measured wall
time, and jumps ahead to the next arrival when there is nothing to do (so a run at 1
request/s does not take minutes of sleeping). For static batching we count each request's
own tokens at the step they were produced, as if its answer streamed out and it did not
have to wait for the batch to end: the kindest reading of static batching.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from minivllm.course.bench.latency import Latencies, latency_percentiles
from minivllm.course.bench.workloads import Workload
from minivllm.engine.llm_engine import LLMEngine
from minivllm.request.sampling_params import SamplingParams


@dataclass
class RequestTiming(Latencies):
    start: float  # its arrival, on the simulated clock
    planned_tokens: int  # the request's own output length
    token_times: list[float] = field(default_factory=list)


def _step(engine: LLMEngine, clock: float, timings: dict[str, RequestTiming]) -> float:
    """One real engine step; stamp each new token with the simulated clock."""
    start = time.perf_counter()
    outputs = engine.step()
    clock += time.perf_counter() - start
    for out in outputs:
        timing = timings[out.request_id]
        if len(timing.token_times) < timing.planned_tokens:  # tokens past its own length are padding work
            timing.token_times.append(clock)
    return clock


def serve_continuous(engine: LLMEngine, workload: Workload) -> list[RequestTiming]:
    """Add each request when it arrives; step while anything is running."""
    timings = {str(i): RequestTiming(a, n) for i, (a, n) in enumerate(zip(workload.arrivals, workload.output_lens))}
    pending = sorted(range(len(workload.prompts)), key=lambda i: workload.arrivals[i])
    clock = 0.0
    while pending or engine.has_unfinished_requests():
        while pending and workload.arrivals[pending[0]] <= clock:
            i = pending.pop(0)
            engine.add_request(prompt=workload.prompts[i], params=_greedy(workload.output_lens[i]), request_id=str(i))
        if engine.has_unfinished_requests():
            clock = _step(engine, clock, timings)
        else:
            clock = workload.arrivals[pending[0]]  # idle until the next request comes
    return list(timings.values())


def serve_static(engine: LLMEngine, workload: Workload, batch_size: int = 16) -> list[RequestTiming]:
    """Take up to batch_size arrived requests, run them all to the longest one's end, repeat."""
    timings = {str(i): RequestTiming(a, n) for i, (a, n) in enumerate(zip(workload.arrivals, workload.output_lens))}
    pending = sorted(range(len(workload.prompts)), key=lambda i: workload.arrivals[i])
    clock = 0.0
    while pending:
        clock = max(clock, workload.arrivals[pending[0]])
        batch = [i for i in pending[:batch_size] if workload.arrivals[i] <= clock]
        pending = pending[len(batch):]
        longest = max(workload.output_lens[i] for i in batch)
        for i in batch:
            engine.add_request(prompt=workload.prompts[i], params=_greedy(longest), request_id=str(i))
        while engine.has_unfinished_requests():
            clock = _step(engine, clock, timings)
    return list(timings.values())


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def latency_summary(timings: list[RequestTiming]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT, ITL and E2E latency (seconds) at p50/p90/p99, plus useful throughput."""
    summary = latency_percentiles(timings)
    makespan = max(t.token_times[-1] for t in timings) - min(t.start for t in timings)
    summary["throughput"] = {"useful_tokens_per_second": sum(t.planned_tokens for t in timings) / makespan}
    return summary
