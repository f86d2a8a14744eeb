"""The benchmark harness every chapter uses: seeded workloads, timing a stage, metrics,
a rich table, and JSON results that record where the numbers came from.

Speeds are only ever *measured* here (and in the scripts that call this), never asserted in
tests: the machine may be shared and noisy, so compare stages side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from minivllm.model import Decoder
from minivllm.stages.common import StageStats

RESULTS_DIR = Path("benchmarks/results")
console = Console()


@dataclass
class Workload:
    """Requests as token ids with the number of tokens each must generate (EOS is ignored,
    so every stage does the same work). `arrivals` (seconds) are for online simulations."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float] | None = None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> str:
        p = [len(x) for x in self.prompts]
        return (f"{self.name}: {len(p)} requests, prompt {min(p)}–{max(p)} tokens (mean {sum(p) / len(p):.0f}), "
                f"output {min(self.output_lens)}–{max(self.output_lens)} (mean {self.num_output_tokens / len(p):.0f})")

    def subset(self, n: int) -> Workload:
        """The first n requests (used to extrapolate very slow stages)."""
        arrivals = self.arrivals[:n] if self.arrivals else None
        return Workload(f"{self.name}[:{n}]", self.prompts[:n], self.output_lens[:n], arrivals)


# name: (requests, prompt range, output distribution). See ../shared/README.md, "Standard workloads".
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": dict(requests=8, prompt=(4, 32), output=("uniform", 1, 16)),
    "classroom": dict(requests=32, prompt=(8, 256), output=("capped_exp", 48, 256)),
    "long_prompt": dict(requests=8, prompt=(256, 448), output=("uniform", 8, 16)),
    "nano": dict(requests=256, prompt=(100, 1024), output=("uniform", 100, 1024)),
    # The GPU ladder (`minivllm tour --device cuda`): nano's shape at half the lengths, so the
    # launch-bound early stages finish their samples in seconds.
    "ladder_gpu": dict(requests=128, prompt=(64, 512), output=("uniform", 32, 256)),
}


def poisson_arrivals(rng: random.Random, n: int, rate: float | None) -> list[float] | None:
    """Arrival times (s) of n requests in a Poisson process of `rate` requests/s, drawn after
    the workload's lengths from the same generator; None (all at once) without a rate."""
    if not rate:
        return None
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


def make_workload(
    name: str, vocab_size: int, seed: int = 0, num_requests: int | None = None, rate: float | None = None
) -> Workload:
    """A seeded synthetic workload of random token ids. With `rate` (requests/s), arrivals
    follow a Poisson process; without it, every request is there at time 0."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    spec = WORKLOADS[name]
    rng = random.Random(seed)
    n = num_requests or spec["requests"]
    lo, hi = spec["prompt"]
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    kind, a, b = spec["output"]
    if kind == "uniform":
        output_lens = [rng.randint(a, b) for _ in range(n)]
    else:  # capped exponential with mean a, at least 1, at most b
        output_lens = [min(b, max(1, round(rng.expovariate(1 / a)))) for _ in range(n)]
    return Workload(name, prompts, output_lens, poisson_arrivals(rng, n, rate))


@dataclass
class StageResult:
    name: str
    seconds: float
    useful_tokens: int
    stats: StageStats = field(default_factory=StageStats)
    peak_gpu_bytes: int | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    note: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds else math.inf

    def row(self) -> dict[str, Any]:
        """What goes into JSON (the outputs themselves are left out)."""
        return dict(
            name=self.name, seconds=self.seconds, useful_tokens=self.useful_tokens,
            tokens_per_second=self.tokens_per_second, padding_waste=self.stats.padding_waste,
            kv_utilisation=self.stats.kv_utilisation, peak_kv_tokens=self.stats.peak_kv_tokens,
            peak_gpu_bytes=self.peak_gpu_bytes, note=self.note,
        )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def useful_tokens(outputs: list[list[int]], output_lens: list[int]) -> int:
    """Requested tokens actually delivered: tokens past a request's own limit do not count."""
    return sum(min(len(out), n) for out, n in zip(outputs, output_lens))


def run_stage(name: str, generate: Any, model: Decoder, workload: Workload, **options: Any) -> StageResult:
    """Time one stage's `generate` over a workload (wall clock, device synchronised)."""
    device = model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats = StageStats()
    synchronize(device)
    start = time.perf_counter()
    outputs = generate(model, workload.prompts, workload.output_lens, stats=stats, **options)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return StageResult(name, seconds, useful_tokens(outputs, workload.output_lens), stats, peak, outputs)


def environment(model: Decoder | None = None) -> dict[str, Any]:
    """Where a number was measured: device, software versions, model shape."""
    import transformers

    info: dict[str, Any] = dict(
        python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
        machine=platform.machine(), cpu_threads=torch.get_num_threads(),
    )
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if model is not None:
        info["device"] = device_name(model.device)
        info["dtype"] = str(model.dtype).removeprefix("torch.")
        info["model"] = asdict(model.config) | {"parameters": model.config.num_parameters()}
    return info


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def save_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def format_tokens_per_second(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def results_table(results: list[StageResult], title: str, baseline: str | None = None) -> Table:
    """A rich table: throughput, speed-up over `baseline` (default: the first row), waste, KV use."""
    base = next((r for r in results if r.name == baseline), results[0]) if results else None
    table = Table(title=title)
    for column in ("stage", "useful tok/s", "speed-up", "padding waste", "KV utilisation", "peak KV tokens", "note"):
        table.add_column(column, justify="left" if column in ("stage", "note") else "right")
    for r in results:
        kv = r.stats.kv_utilisation
        table.add_row(
            r.name, format_tokens_per_second(r.tokens_per_second),
            f"{r.tokens_per_second / base.tokens_per_second:.1f}×" if base else "",
            f"{r.stats.padding_waste:.0%}", "—" if kv is None else f"{kv:.0%}",
            f"{r.stats.peak_kv_tokens:,}" if r.stats.peak_kv_tokens else "—", r.note,
        )
    return table


def chapter_parser(description: str) -> argparse.ArgumentParser:
    """The command line every chapter script shares."""
    parser = argparse.ArgumentParser(description=description)
    add_model_arguments(parser)
    return parser


def add_model_arguments(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """--model, --device, --dtype and (with `seed`) --seed: what every script, `minivllm tour`
    and `minivllm serve` run on."""
    parser.add_argument("--model", default=None, help="checkpoint folder, hub id or config.json (default: the embedded model)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: fp32 on CPU, bf16 on CUDA")
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")


def dtype_argument(args: argparse.Namespace) -> torch.dtype | None:
    """--dtype as a torch dtype (None: the device's default)."""
    return getattr(torch, args.dtype) if args.dtype else None


def load_for_chapter(args: argparse.Namespace) -> Decoder:
    """Load the model named on a chapter's command line and say what was loaded."""
    from minivllm.loader import load_model

    model = load_model(args.model, device=args.device, dtype=dtype_argument(args))
    cfg = model.config
    console.print(f"[bold]model[/] {args.model or 'embedded default'} ({cfg.model_type}, "
                  f"{cfg.num_parameters() / 1e6:.1f}M parameters) on {device_name(model.device)}, "
                  f"{str(model.dtype).removeprefix('torch.')}")
    return model


def time_stream(tokens: Iterator[int], device: torch.device) -> list[float]:
    """Seconds each token of a token stream took to appear (device synchronised)."""
    times, last = [], time.perf_counter()
    for _ in tokens:
        synchronize(device)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def kv_size_table(configs: dict[str, Any], dtype: torch.dtype, context: int = 4096) -> Table:
    """KV-cache bytes per token for several model shapes: 2 (K and V) x layers x kv_heads x
    head_dim x bytes per element, per layer and for the whole model."""
    element = torch.tensor([], dtype=dtype).element_size()
    table = Table(title=f"KV cache per token ({str(dtype).removeprefix('torch.')})")
    for column in ("model", "layers × kv heads × head dim", "per layer", "per token", f"{context:,}-token context"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, cfg in configs.items():
        per_token = cfg.kv_bytes_per_token(dtype)
        table.add_row(name, f"{cfg.num_layers} × {cfg.num_kv_heads} × {cfg.head_dim}",
                      format_bytes(2 * cfg.num_kv_heads * cfg.head_dim * element), format_bytes(per_token),
                      format_bytes(per_token * context))
    return table


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------------
# Workloads that repeat themselves (chapter 11): the prefix cache only helps when requests
# begin with the same tokens.
# ------------------------------------------------------------------------------------------


def _check_range(name: str, value: Any, minimum: int) -> tuple[int, int]:
    """A (lo, hi) pair of ints with minimum <= lo <= hi, or a ValueError saying what is wrong."""
    if (not isinstance(value, tuple) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
            or not minimum <= value[0] <= value[1]):
        raise ValueError(f"{name} must be a (lo, hi) tuple of ints with {minimum} <= lo <= hi, got {value!r}")
    return value


def _check_count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def make_shared_prefix_workload(
    vocab_size: int, prefix_len: int, num_requests: int = 32, suffix: tuple[int, int] = (23, 200),
    output: tuple[int, int] = (8, 32), seed: int = 0, rate: float | None = None,
) -> Workload:
    """Requests that all begin with one system prompt of `prefix_len` random tokens, followed by
    a user part of its own (uniform in `suffix` tokens), with short outputs (uniform in `output`).

    The defaults are the standard "shared prefix" workload around a 200-token system prompt:
    prompts of 223-400 tokens, of which the shared part is 50-90 %. A sweep over the shared
    share of a fixed prompt length P uses suffix=(P - prefix_len, P - prefix_len). With `rate`
    (requests/s) arrivals follow a Poisson process, as in make_workload."""
    _check_count("vocab_size", vocab_size, 1)
    _check_count("prefix_len", prefix_len, 0)
    _check_count("num_requests", num_requests, 1)
    lo, hi = _check_range("suffix", suffix, 1)  # at least one token of its own: requests differ
    out_lo, out_hi = _check_range("output", output, 1)
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    prompts = [system + [rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(num_requests)]
    output_lens = [rng.randint(out_lo, out_hi) for _ in range(num_requests)]
    return Workload(f"shared prefix {prefix_len}", prompts, output_lens, poisson_arrivals(rng, num_requests, rate))


@dataclass
class MultiTurnWorkload:
    """Chats: conversation c's turn t sends messages[c][t] (token ids) and asks for
    output_lens[c][t] tokens. Turn t's prompt is everything so far, turn t-1's prompt and its
    answer, followed by the new message, so it can only be built once turn t-1 has answered
    (see prompts())."""

    name: str
    messages: list[list[list[int]]]  # [conversation][turn] -> the user's new tokens
    output_lens: list[list[int]]  # [conversation][turn]

    @property
    def num_turns(self) -> int:
        return len(self.messages[0])

    @property
    def longest_conversation(self) -> int:
        """Tokens in the longest finished conversation: it must fit the model's context."""
        return max(sum(map(len, m)) + sum(n) for m, n in zip(self.messages, self.output_lens))

    def prompts(self, turn: int, histories: list[list[int]]) -> list[list[int]]:
        """Turn `turn`'s prompts: each conversation's history (turn-1's prompt + its output
        tokens; [] before the first turn) followed by its new message."""
        if len(histories) != len(self.messages):
            raise ValueError(f"expected {len(self.messages)} histories, got {len(histories)}")
        return [history + messages[turn] for history, messages in zip(histories, self.messages)]

    def describe(self) -> str:
        first = [len(m[0]) for m in self.messages]
        later = [len(x) for m in self.messages for x in m[1:]] or [0]
        outs = [n for row in self.output_lens for n in row]
        return (f"{self.name}: {len(self.messages)} conversations × {self.num_turns} turns, first message "
                f"{min(first)}–{max(first)} tokens, later ones {min(later)}–{max(later)}, answers "
                f"{min(outs)}–{max(outs)}; longest conversation {self.longest_conversation} tokens")


def make_multi_turn_workload(
    vocab_size: int, num_conversations: int = 8, turns: int = 5, first: tuple[int, int] = (48, 96),
    message: tuple[int, int] = (8, 40), output: tuple[int, int] = (8, 40), seed: int = 0,
) -> MultiTurnWorkload:
    """Seeded chats of random tokens: a first message of `first` tokens, then turns - 1 more of
    `message` tokens, each answered with `output` tokens (uniform ranges). The defaults end
    below 500 tokens, inside the embedded model's 512-token context."""
    _check_count("vocab_size", vocab_size, 1)
    _check_count("num_conversations", num_conversations, 1)
    _check_count("turns", turns, 1)
    ranges = [_check_range("first", first, 1), _check_range("message", message, 1)]
    out_lo, out_hi = _check_range("output", output, 1)
    rng = random.Random(seed)
    messages = [[[rng.randrange(vocab_size) for _ in range(rng.randint(*ranges[min(t, 1)]))] for t in range(turns)]
                for _ in range(num_conversations)]
    output_lens = [[rng.randint(out_lo, out_hi) for _ in range(turns)] for _ in range(num_conversations)]
    return MultiTurnWorkload("multi-turn chat", messages, output_lens)
