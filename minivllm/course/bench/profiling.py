"""Where one engine step's time goes (chapter 9): profile a few steady decode steps.

A decode step of a small model does little arithmetic, so its time goes to everything around
the arithmetic: planning the step, building the batch tensors, Python walking through every
layer and asking PyTorch for each small operation, choosing the tokens. `torch.profiler` sees
all of it. The engine already names the parts of a step as profiler ranges (`STEP_PHASES` in
engine/llm_engine.py: schedule, prepare, forward, sample, finish); `profile_steps` brings an
engine to a steady state (N requests, all decoding, contexts around a chosen length), records
a few steps, and turns the trace into plain data:

- per step, the phases as host time spans, each decoder layer's span inside "forward", the
  top-level operator calls the host made (the aten ops Python asked for; what they call inside
  is nested in them and not repeated), and, on a GPU, the device's kernels on the same clock;
- how many kernels the host launched (CUDA runtime calls such as cudaLaunchKernel,
  cuLaunchKernel for Triton, cudaGraphLaunch for a replayed graph). A CPU launches no kernels:
  there the count is of operator calls, and is labelled so;
- host time per phase, host time spent inside operators, and the time the device was busy.

Only a few long-standing attributes of the profiler's events are read (name, time range,
thread, device type), so the same code runs on torch 2.4 to 2.15; step boundaries and the
device kernels of each step are found by time, not through correlation ids that changed
between versions.

    python -m minivllm.course.bench.profiling [--model SRC] [--device cpu|cuda] [--batch-size 16] [--context 200]

writes figures/09_step_timeline.png and benchmarks/results/09_step_profile_<device>.json.
"""
from __future__ import annotations

import itertools
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from minivllm.config.engine import check_setting
from minivllm.engine.llm_engine import STEP_PHASES, LLMEngine
from minivllm.entrypoints.llm import LLM
from minivllm.machine import device_name, synchronize
from minivllm.model import Decoder
from minivllm.request.sampling_params import SamplingParams
from minivllm.request.sequence import Sequence

# The engine settings chapter 9 compares (keyword arguments of LLM / LLMEngine), each synchronous as
# chapter 9 built it, and chapter 16's overlap on top of the fastest, with and without the pieces that
# replay prompt-carrying steps ("graphs" means both kinds of graph: piecewise_graphs follows cuda_graphs). On a CPU only "eager" exists:
# there are no CUDA graphs, the fused ops are GPU kernels, and the overlap needs a device to overlap with.
VARIANTS: dict[str, dict[str, bool]] = {
    "eager": dict(cuda_graphs=False, fused_ops=False, async_scheduling=False),
    "graphs": dict(cuda_graphs=True, fused_ops=False, async_scheduling=False),
    "graphs+fused": dict(cuda_graphs=True, fused_ops=True, async_scheduling=False),
    # Decode graphs alone: steps that carry prompt tokens run eagerly (as before piecewise_graphs.py).
    "decode-graphs+fused+async": dict(cuda_graphs=True, piecewise_graphs=False, fused_ops=True, async_scheduling=True),
    "graphs+fused+async": dict(cuda_graphs=True, fused_ops=True, async_scheduling=True),
}
STEP_RANGE = "profiled step"  # the range profile_steps wraps around each engine.step()
LAYER_RANGE = "layer"  # "layer 0", "layer 1", ...: each decoder layer's forward, while profiling
# CUDA runtime and driver calls that start work on the GPU (prefixes: the ...Ex variants too).
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch")
# Calls in which the host waits for the GPU. A copy counts: reading the sampled tokens (`.tolist()`)
# copies into pageable host memory, which returns only when the GPU has finished everything queued
# before it (~6 ms of a 9.5 ms step at batch 256 on an H200, all of it booked as a copy call); the
# step's one non-blocking copy to the device returns in microseconds, so counting it costs nothing.
WAIT_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def variants_for(device: torch.device | str) -> list[str]:
    """The VARIANTS that can run on this device."""
    return list(VARIANTS) if torch.device(device).type == "cuda" else ["eager"]


class Span(NamedTuple):
    """Something that took time: its name and its start and end, in ms from the step's start.
    A tuple, so a step's thousands of spans stay small in JSON ([name, start, end])."""

    name: str
    start: float
    end: float


@dataclass
class ProfiledStep:
    """One engine step as the profiler saw it. Times in ms from the step's start."""

    wall_ms: float  # the whole engine.step() call, on the host
    batch_size: int  # requests that decoded one token in this step
    launches: int  # kernel launches the host made (GPU); top-level operator calls on a CPU, which launches none
    phases: list[Span]  # the engine's named phases, in the order they ran
    layers: list[Span]  # each decoder layer's forward, when Python ran it (not in a replayed graph)
    host_ops: list[Span]  # top-level operator calls on the engine's thread (and CUDA calls made from Python)
    kernels: list[Span] = field(default_factory=list)  # device work that started in this step (GPU only)
    runtime_calls: dict[str, int] = field(default_factory=dict)  # CUDA runtime/driver calls by name (GPU only)
    wait_ms: float = 0.0  # host time inside synchronize and copy calls: waiting for the GPU (GPU only)

    def phase_order(self) -> list[str]:
        """Phase names in order, a phase entered twice in a row counted once."""
        return [s.name for i, s in enumerate(self.phases) if i == 0 or self.phases[i - 1].name != s.name]

    def host_ms(self) -> dict[str, float]:
        """Host time per phase, plus "other": step time outside every phase."""
        times = {name: 0.0 for name in self.phase_order()}
        for s in self.phases:
            times[s.name] += s.end - s.start
        times["other"] = max(0.0, self.wall_ms - sum(times.values()))
        return {name: round(ms, 4) for name, ms in times.items()}

    def op_ms(self) -> dict[str, float]:
        """Host time inside top-level operator calls, per phase. The rest of a phase is Python
        (and the dispatcher) between the calls."""
        times = {name: 0.0 for name in self.phase_order()}
        for op in self.host_ops:
            phase = next((s.name for s in self.phases if s.start <= op.start < s.end), "other")
            times[phase] = times.get(phase, 0.0) + op.end - op.start
        return {name: round(ms, 4) for name, ms in times.items()}

    def device_busy_ms(self) -> float | None:
        """Time the device was running at least one kernel or copy (None on a CPU)."""
        if not self.kernels:
            return None
        busy, end = 0.0, float("-inf")
        for s in sorted(self.kernels, key=lambda k: k.start):  # the union of the intervals
            if s.end > end:
                busy += s.end - max(s.start, end)
                end = s.end
        return busy


@dataclass
class StepProfile:
    """Steady decode steps of one engine setting, with what they ran on.

    `to_dict()` is the JSON form (each step also carries its derived numbers, and a summary is
    added); the plots in minivllm/course/plots/profile.py read that form, so a figure can be redrawn
    from a results file."""

    device: str  # as bench.device_name prints it
    device_type: str  # "cpu" or "cuda"
    dtype: str
    model: str  # the model's shape, in words
    variant: str
    options: dict[str, Any]  # engine settings passed to LLMEngine
    batch_size: int
    context: int  # mean context (cached tokens) of the requests at the first profiled step
    steps: list[ProfiledStep]
    plain_step_ms: list[float] = field(default_factory=list)  # steady steps without the profiler (_time_steps)

    @property
    def count_label(self) -> str:
        return "kernel launches" if self.device_type == "cuda" else "operator calls"

    def summary(self) -> dict[str, Any]:
        """Medians over the steps, and which steps are the median and the fastest (by wall time).
        On a shared machine the fastest step is the one other programs disturbed least."""
        order = sorted(range(len(self.steps)), key=lambda i: self.steps[i].wall_ms)
        host = [s.host_ms() for s in self.steps]
        busy = [s.device_busy_ms() for s in self.steps]
        return dict(
            median_step=order[len(order) // 2], fastest_step=order[0],
            wall_ms=statistics.median(s.wall_ms for s in self.steps),
            plain_step_ms=statistics.median(self.plain_step_ms) if self.plain_step_ms else None,
            host_ms={name: statistics.median(h.get(name, 0.0) for h in host) for name in host[0]},
            launches=statistics.median(s.launches for s in self.steps),
            count_label=self.count_label,
            device_busy_ms=None if None in busy else statistics.median(busy),
            wait_ms=statistics.median(s.wait_ms for s in self.steps),
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for step, row in zip(self.steps, d["steps"]):
            row.update(phase_order=step.phase_order(), host_ms=step.host_ms(), op_ms=step.op_ms(),
                       device_busy_ms=step.device_busy_ms())
        d["count_label"] = self.count_label
        d["summary"] = self.summary()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepProfile:
        names = set(cls.__dataclass_fields__)
        steps = []
        for row in d["steps"]:
            fields = {k: v for k, v in row.items() if k in ProfiledStep.__dataclass_fields__}
            for key in ("phases", "layers", "host_ops", "kernels"):
                fields[key] = [Span(*s) for s in fields.get(key, [])]
            steps.append(ProfiledStep(**fields))
        return cls(**{k: v for k, v in d.items() if k in names and k != "steps"}, steps=steps)


def profile_steps(
    engine: LLMEngine | LLM | Decoder | Any = None, *, batch_size: int = 16, context: int = 200, steps: int = 5,
    warmup: int = 3, seed: int = 0, variant: str | None = None, label_layers: bool = True, **engine_options: Any,
) -> StepProfile:
    """Profile `steps` decode steps of `batch_size` requests with contexts around `context`.

    engine: an idle LLMEngine or LLM, or a model (a Decoder or anything load_model accepts,
    None for the embedded one) to build an LLMEngine from, with `engine_options` (say
    `**VARIANTS["graphs"]`; the KV pool is sized to these requests unless num_kv_blocks is
    given; prefix caching, chapter 11's, is off unless asked for: this is chapter 9's engine).
    The requests (random token ids, prompts within 10% of `context`, greedy, EOS ignored) are
    added, stepped until every one is decoding, stepped `warmup` more times, and then
    profiled; they are aborted afterwards. label_layers marks each decoder layer's forward
    as a profiler range ("layer N"), which costs the host a few microseconds per layer."""
    for name, value, minimum in (("batch_size", batch_size, 1), ("context", context, 10), ("steps", steps, 1),
                                 ("warmup", warmup, 0)):
        check_setting(name, value, minimum)
    if isinstance(engine, (LLM, LLMEngine)):
        if engine_options:
            raise ValueError(f"engine options {sorted(engine_options)} apply only when profile_steps builds the "
                             f"engine; this one exists already")
        engine = engine.engine if isinstance(engine, LLM) else engine
        budget = engine.core.scheduler.max_num_batched_tokens
    else:
        budget = engine_options.get("max_num_batched_tokens", 2048)
    # Every request must still be running at the last profiled step. Requests whose prompts go
    # in first start decoding while the others' prompts are still being computed, so they need
    # a token more for every step the prompts take.
    longest_prompt = context + context // 10
    max_tokens = warmup + 2 * steps + 3 + -(-batch_size * longest_prompt // budget)
    if not isinstance(engine, LLMEngine):
        options = {"enable_prefix_caching": False} | engine_options
        engine = LLMEngine(engine, **_sized_pool(options, batch_size, longest_prompt + max_tokens))
    if longest_prompt + max_tokens > engine.max_model_len:
        raise ValueError(f"context {context} (prompts up to {longest_prompt}) plus {max_tokens} tokens to generate "
                         f"does not fit max_model_len={engine.max_model_len}")
    if engine.has_unfinished_requests():
        raise ValueError("profile_steps needs an idle engine: this one still has unfinished requests")
    if variant is None:
        variant = next((name for name, opts in VARIANTS.items() if opts == engine_options), None)
        variant = variant or ", ".join(f"{k}={v}" for k, v in engine_options.items()) or "default settings"

    ids = _start_decoding(engine, batch_size, context, max_tokens, seed)
    try:
        for _ in range(warmup):
            engine.step()
        plain = _time_steps(engine, steps)
        prof, decoded, mean_context = _record(engine, steps, label_layers)
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
    events = _events(prof)
    model, cfg = engine.model, engine.model.config
    return StepProfile(
        device=device_name(model.device), device_type=model.device.type, dtype=str(model.dtype).removeprefix("torch."),
        model=(f"{cfg.model_type} {cfg.num_parameters() / 1e6:.1f}M params, {cfg.num_layers} layers, "
               f"hidden {cfg.hidden_size}"),
        variant=variant, options=dict(engine_options), batch_size=batch_size, context=mean_context,
        steps=[_step_from_events(events, i, n, model.device.type == "cuda") for i, n in enumerate(decoded)],
        plain_step_ms=plain,
    )


def _sized_pool(options: dict[str, Any], requests: int, tokens: int) -> dict[str, Any]:
    """Engine options with a KV pool that holds `requests` requests of `tokens` tokens, unless
    num_kv_blocks is given: the engine's default takes most of a GPU's free memory, and every
    variant profiled builds an engine of its own."""
    if "num_kv_blocks" in options:
        return options
    # One block more per request: the scheduler admits a request only while a free block per
    # running request would remain for their next tokens.
    return dict(options, num_kv_blocks=requests * (-(-tokens // options.get("block_size", 16)) + 1))


def _start_decoding(engine: LLMEngine, batch_size: int, context: int, max_tokens: int, seed: int) -> list[str]:
    """Add the requests and step until each has its prompt cached and is decoding."""
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spread = context // 10
    ids = []
    try:
        for _ in range(batch_size):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(context - spread, context + spread))]
            ids.append(engine.add_request(prompt=prompt, params=params))
        for _ in range(batch_size * (context + spread)):  # more than enough steps for any prefill
            if any(i not in engine.requests for i in ids):
                raise RuntimeError("a request finished before all of them were decoding: the engine cannot hold "
                                   f"{batch_size} requests of ~{context} tokens at once (KV blocks, max_num_seqs)")
            if all(s.output_token_ids and s.num_computed_tokens == s.num_tokens - 1 for s in _sequences(engine)):
                return ids
            engine.step()
        raise RuntimeError("the requests never all reached decoding")
    except BaseException:
        for request_id in ids:
            engine.abort_request(request_id)
        raise


def _sequences(engine: LLMEngine) -> list[Sequence]:
    """Every sequence of every unfinished request (a request holds n of them; here n = 1)."""
    return [seq for group in engine.core.requests.values() for seq in group.seqs]


@contextmanager
def _named_layers(model: Decoder) -> Iterator[None]:
    """Mark every decoder layer's forward as a profiler range "layer N" (forward hooks)."""
    ranges: dict[int, record_function] = {}

    def enter(index: int, module: torch.nn.Module, args: Any) -> None:
        ranges[index] = record_function(f"{LAYER_RANGE} {index}")
        ranges[index].__enter__()

    def leave(index: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        ranges.pop(index).__exit__(None, None, None)

    handles = []
    for i, layer in enumerate(model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: enter(i, m, a)))
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: leave(i, m, a, o)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _time_steps(engine: LLMEngine, steps: int) -> list[float]:
    """How long each of `steps` engine steps takes in steady state, without the profiler (which
    adds a little to every operator call it records), in ms.

    The host never waits inside the loop: a step that waited for the GPU after returning
    (`step(); synchronize()`) would drain the queue every time, so step N + 1 could never be
    queued while step N runs, and chapter 16's overlap would be timed away. On a GPU an event is
    recorded on the stream after each step (recording does not wait); the one synchronize at the
    end reads them, and step i's time is the device clock from the end of step i - 1's work to
    the end of step i's: what the GPU really spends per step, idle gaps included. On a CPU the
    work is done when step() returns, so each step's host time is its time."""
    device = engine.model.device
    if device.type != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(round(1e3 * (time.perf_counter() - start), 4))
        return times
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    synchronize(device)
    marks[0].record()
    for mark in marks[1:]:
        engine.step()
        mark.record()
    synchronize(device)  # the one wait: after the last step
    return [round(before.elapsed_time(after), 4) for before, after in itertools.pairwise(marks)]


def _record(engine: LLMEngine, steps: int, label_layers: bool) -> tuple[profile, list[int], int]:
    """Profile `steps` engine steps, each inside a "profiled step i" range. Returns the
    profiler, how many requests decoded in each step, and their mean context at the first."""
    device = engine.model.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    decoded = []
    layers = _named_layers(engine.model) if label_layers else _nothing()
    with layers, profile(activities=activities) as prof:
        engine.step()  # the profiler's first step is slow (it sets itself up): not kept
        synchronize(device)
        seqs = _sequences(engine)
        mean_context = round(sum(s.num_tokens for s in seqs) / len(seqs))
        for i in range(steps):
            before = [s.num_computed_tokens for s in seqs]
            with record_function(f"{STEP_RANGE} {i}"):
                engine.step()
            # Outside the step's range: the GPU finishes this step before the next one starts,
            # so each kernel belongs to the step whose window it starts in.
            synchronize(device)
            decoded.append(sum(s.num_computed_tokens == n + 1 for s, n in zip(seqs, before)))
    return prof, decoded, mean_context


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class _Event(NamedTuple):
    name: str
    start: float  # ms on the profiler's clock
    end: float
    thread: int
    on_device: bool
    annotation: bool  # a record_function range rather than an operator


def _events(prof: profile) -> list[_Event]:
    """The profiler's events, reduced to the few attributes every torch version has."""
    events = []
    for ev in prof.events():
        on_device = getattr(ev, "device_type", DeviceType.CPU) != DeviceType.CPU
        annotation = bool(getattr(ev, "is_user_annotation", False)) or ev.name in STEP_PHASES or \
            ev.name.startswith((STEP_RANGE, LAYER_RANGE + " "))
        events.append(_Event(ev.name, ev.time_range.start / 1e3, ev.time_range.end / 1e3, ev.thread, on_device,
                             annotation))
    return events


def _step_from_events(events: list[_Event], index: int, batch_size: int, on_gpu: bool) -> ProfiledStep:
    """Cut profiled step `index` out of the whole trace (times relative to its start)."""
    marks = sorted((e for e in events if not e.on_device and e.name.startswith(STEP_RANGE + " ")),
                   key=lambda e: e.start)
    step = next(e for e in marks if e.name == f"{STEP_RANGE} {index}")
    later = [m.start for m in marks if m.start > step.start]
    window_end = later[0] if later else float("inf")  # device work may end after the host's step
    host = [e for e in events if not e.on_device and e.thread == step.thread and e is not step
            and step.start <= e.start and e.end <= step.end]
    annotations = {e.name for e in events if e.annotation}  # the device's copies of host ranges are not work

    def span(e: _Event) -> Span:
        return Span(e.name, round(e.start - step.start, 4), round(e.end - step.start, 4))

    phases = sorted((span(e) for e in host if e.name in STEP_PHASES), key=lambda s: s.start)
    layers = sorted((span(e) for e in host if e.name.startswith(LAYER_RANGE + " ")), key=lambda s: s.start)
    # Top-level operator calls: operators not nested inside another operator of this step.
    top, reach = [], float("-inf")
    for e in sorted((e for e in host if not e.annotation), key=lambda e: (e.start, -e.end)):
        if e.start >= reach:
            top.append(span(e))
            reach = e.end
    kernels = sorted((span(e) for e in events if e.on_device and e.name not in annotations
                      and step.start <= e.start < window_end), key=lambda s: s.start)
    runtime = Counter(e.name for e in host if e.name.startswith("cu") and not e.annotation)
    launches = sum(n for name, n in runtime.items() if name.startswith(LAUNCH_CALLS)) if on_gpu else len(top)
    wait = sum(e.end - e.start for e in host if e.name.startswith(WAIT_CALLS))
    return ProfiledStep(wall_ms=round(step.end - step.start, 4), batch_size=batch_size, launches=launches,
                        phases=phases, layers=layers, host_ops=top, kernels=kernels, runtime_calls=dict(runtime),
                        wait_ms=round(wait, 4))


def profile_variants(
    model: Decoder, variants: list[str] | None = None, **kwargs: Any
) -> list[StepProfile]:
    """profile_steps for each named VARIANT (default: every one this device can run), each on
    a fresh engine around the same model."""
    variants = variants or variants_for(model.device)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return [profile_steps(model, variant=name, **VARIANTS[name], **kwargs) for name in variants]
