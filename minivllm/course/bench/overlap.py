"""Measuring chapter 16's overlap: step time against host time and device time.

On a CPU the model runs on the host's own cores, so async scheduling has nothing to overlap
with. To see the mechanism anyway, `StandInDevice` plays a GPU: each launched step occupies it
for a fixed time, one step after another as on a CUDA stream, on a thread that sleeps (the GIL
is free, as it is while a GPU computes); the host waits for a step only where the engine reads
its tokens (`SampledTokens.chosen`, where a GPU engine waits for its copy event). The model
itself never runs: the sampler gets fixed logits, so what the host does per step is exactly the
engine's own work (schedule, prepare, sample, finish), as in benchmarks/host_step.py.

The prediction: a synchronous step takes host + device; an overlapped one max(host, device).
`overlap_table` measures both for several device times. `gpu_overlap` is the real thing on a
GPU: step time against GPU busy time, with and without async scheduling.
"""
from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from minivllm.engine.llm_engine import LLMEngine
from minivllm.loader import load_model
from minivllm.request.sampling_params import RequestOutputKind, SamplingParams
from minivllm.worker.prepare import device_step

# A decoder that is never run: only its shape matters (the KV pool, the vocabulary of the logits).
STAND_IN_CONFIG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                       head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=True, torch_dtype="float32", eos_token_id=0)


class PendingTokens:
    """A step's sampled ids as the engine holds them while the stand-in device still runs the
    step: reading them (`tolist`) waits for the device, as reading a GPU's copy does."""

    is_cuda = False

    def __init__(self, tokens: torch.Tensor, done: Future, waits: list[float]):
        self.tokens, self.done, self.waits = tokens, done, waits

    def tolist(self) -> list[int]:
        start = time.perf_counter()
        self.done.result()
        self.waits.append(time.perf_counter() - start)  # the host idle, waiting for the device
        return self.tokens.tolist()


class StandInDevice:
    """A device that runs every launched step for `seconds`, in launch order, while the host goes on."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.stream = ThreadPoolExecutor(max_workers=1)  # one worker: steps queue as on one CUDA stream
        self.busy: list[float] = []  # how long each step really kept it busy (a sleep may overshoot)
        self.waits: list[float] = []  # how long the host waited for it, each time it read tokens

    def _run(self) -> None:
        start = time.perf_counter()
        time.sleep(self.seconds)
        self.busy.append(time.perf_counter() - start)

    def launch(self) -> Future:
        return self.stream.submit(self._run)

    def close(self) -> None:
        self.stream.shutdown(wait=True)


def stand_in_engine(batch_size: int, context: int, max_tokens: int, device: StandInDevice, async_scheduling: bool,
                    seed: int = 0) -> LLMEngine:
    """An engine whose model runs on `device`: its prepare and sampler are the real ones, its
    forward is a launch on the stand-in device and fixed logits. batch_size requests of
    ~context prompt tokens each (within 10 %), greedy, EOS ignored, FINAL_ONLY outputs."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(STAND_IN_CONFIG))
        model = load_model(Path(folder) / "config.json", device="cpu", dtype=torch.float32)
    spread = context // 10
    blocks = batch_size * (-(-(context + spread + max_tokens + 2) // 16) + 1)
    engine = LLMEngine(model, num_kv_blocks=blocks, max_num_seqs=batch_size, async_scheduling=async_scheduling,
                       max_model_len=STAND_IN_CONFIG["max_position_embeddings"], enable_prefix_caching=False)
    logits = torch.randn(batch_size, STAND_IN_CONFIG["vocab_size"], generator=torch.Generator().manual_seed(seed))
    runner, sample = engine.core.runner, engine.core.sampler.sample
    launched: list[Future] = []

    def run(schedule, previous=None):  # the runner's prepare, then the device's turn
        arrays = runner.batch.step_arrays(schedule.seqs, schedule.num_new_tokens)
        device_step(arrays, runner.batch.to_device(arrays.pack()))
        launched.append(device.launch())
        return arrays.samplers, logits[:len(arrays.samplers)], {}

    def sample_on_device(*args):
        tokens, logprobs = sample(*args)
        return PendingTokens(tokens, launched[-1], device.waits), logprobs

    runner.run, engine.core.sampler.sample = run, sample_on_device
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(batch_size):
        prompt = [rng.randrange(1, STAND_IN_CONFIG["vocab_size"]) for _ in range(rng.randint(context - spread,
                                                                                              context + spread))]
        engine.add_request(prompt=prompt, params=params)
    return engine


class Measured:
    """One engine on its own stand-in device, brought to steady decoding, timed a block of steps
    at a time (so that two of them can take turns on a shared machine)."""

    def __init__(self, batch_size: int, context: int, steps: int, device_ms: float, async_scheduling: bool,
                 seed: int = 0):
        self.device = StandInDevice(device_ms / 1e3)
        self.engine = stand_in_engine(batch_size, context, steps + 8, self.device, async_scheduling, seed)
        seqs = [seq for group in self.engine.core.requests.values() for seq in group.seqs]
        while not all(s.num_computed_tokens >= s.num_prompt_tokens for s in seqs):
            self.engine.step()  # the prompts: not measured
        self.times: list[float] = []
        self.host: list[float] = []

    def run(self, steps: int) -> None:
        """Time `steps` steps, after one untimed step that refills the pipeline (under async
        scheduling, one step in flight)."""
        device = self.device
        self.engine.step()
        for _ in range(steps):
            waited = len(device.waits)
            start = time.perf_counter()
            self.engine.step()
            self.times.append(time.perf_counter() - start)
            self.host.append(self.times[-1] - sum(device.waits[waited:]))

    def summary(self) -> dict[str, float]:
        """Medians in ms: the step, the device's busy time per step, the host's own time (the
        step less the time it waited for the device)."""
        return dict(step_ms=1e3 * statistics.median(self.times), device_ms=1e3 * statistics.median(self.device.busy),
                    host_ms=1e3 * statistics.median(self.host))

    def close(self) -> None:
        self.device.close()


def overlap_table(batch_size: int, context: int, steps: int, device_ms: list[float], rounds: int = 3,
                  progress: Any = None) -> dict[str, Any]:
    """For each device time asked for: the synchronous and the overlapped step (medians over
    `steps` steps each, in `rounds` turns, so that both see the same machine), the device's
    measured busy time, the host's own time (from the synchronous engine), and the two
    predictions, host + device and max(host, device)."""
    rows = []
    for ms in device_ms:
        engines = [Measured(batch_size, context, steps + rounds, ms, overlap) for overlap in (False, True)]
        try:
            for r in range(rounds):
                for engine in engines if r % 2 == 0 else engines[::-1]:
                    engine.run(-(-steps // rounds))
            sync, overlapped = (engine.summary() for engine in engines)
        finally:
            for engine in engines:
                engine.close()
        host, device = sync["host_ms"], sync["device_ms"]
        rows.append(dict(asked_device_ms=ms, device_ms=device, host_ms=host, sync_ms=sync["step_ms"],
                         async_ms=overlapped["step_ms"], async_host_ms=overlapped["host_ms"],
                         host_plus_device_ms=host + device, max_host_device_ms=max(host, device),
                         speedup=sync["step_ms"] / overlapped["step_ms"]))
        if progress is not None:
            progress(rows[-1])
    return dict(batch_size=batch_size, context=context, steps=steps, rounds=rounds, rows=rows)


def gpu_overlap(model: Any, batch_size: int = 256, context: int = 600, steps: int = 20, **engine_options: Any
                ) -> dict[str, Any]:
    """On a GPU: decode steps at batch_size with and without async scheduling, each step's wall
    time against the GPU's busy time in it (bench.profiling's profile_steps, whose step times
    come from events between steps with one synchronize at the end: steady state; the target
    is step <= 1.10 x busy). engine_options: the other settings (CUDA graphs, fused ops: the
    defaults on a GPU). Returns both summaries and the two ratios."""
    from minivllm.course.bench.profiling import profile_steps

    out: dict[str, Any] = {}
    for overlap in (False, True):
        profile = profile_steps(model, batch_size=batch_size, context=context, steps=steps, async_scheduling=overlap,
                                **engine_options)
        summary = profile.summary()
        out["async" if overlap else "sync"] = summary | dict(profile=profile.to_dict())
    for name in ("sync", "async"):
        s = out[name]
        busy = s.get("device_busy_ms")
        out[f"{name}_step_over_busy"] = None if not busy else s["plain_step_ms"] / busy
    return out
