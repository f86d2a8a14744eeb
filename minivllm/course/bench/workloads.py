"""The standard workloads (see the README's "Standard workloads"): seeded requests of random
token ids with fixed output lengths (EOS is ignored, so every runner does the same work), and
the workloads that repeat themselves for chapter 11's prefix cache.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


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


def warmup_workloads(work: Workload) -> list[Workload]:
    """What to run on an engine before timing `work` on it, so that nothing is compiled while
    the clock runs (run them in this order, each to the end).

    Triton compiles a kernel once per variant: once its per-step arguments are left
    unspecialised (chapter 9), a variant is a path through the step. An engine's steps take
    three: prefill chunks (every step that holds one), decode in one pass per sequence (where
    the batch fills the GPU, or contexts are short) and decode of contexts split into
    partitions, then merged (decode_plan in attention/triton_kernels.py decides). So:
    1. every request's prompt with 2 output tokens: the timed run's prefill steps, then decode
       steps of the requests whose prefill ended last;
    2. every request's first 8 prompt tokens, 2 output tokens: a decode step at contexts so
       short that it runs in one pass whatever the batch (the timed run's full batches may run
       in one pass, and step 1's last decode step may hold too few requests to);
    3. its longest prompt alone, with 8 output tokens: decode steps of one long context.
    (CUDA graphs are captured when the engine is built; they need no warm-up.)"""
    longest = max(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))
    return [Workload(f"{work.name}: every prompt, 2 tokens", work.prompts, [min(2, n) for n in work.output_lens]),
            Workload(f"{work.name}: every prompt's first 8 tokens, 2 tokens", [p[:8] for p in work.prompts],
                     [min(2, n) for n in work.output_lens]),
            Workload(f"{work.name}: the longest prompt alone", [work.prompts[longest]], [min(8, work.output_lens[longest])])]


# name: (requests, prompt range, output distribution). See ../shared/README.md, "Standard workloads".
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": dict(requests=8, prompt=(4, 32), output=("uniform", 1, 16)),
    "classroom": dict(requests=32, prompt=(8, 256), output=("capped_exp", 48, 256)),
    # Chapter 15: short turns, classroom's answers; with a tiny model a step is then mostly the host's work.
    "chat": dict(requests=64, prompt=(8, 32), output=("capped_exp", 48, 256)),
    "long_prompt": dict(requests=8, prompt=(256, 448), output=("uniform", 8, 16)),
    "nano": dict(requests=256, prompt=(100, 1024), output=("uniform", 100, 1024)),
    # The GPU ladder (`minivllm tour --device cuda`): nano's shape at half the lengths, so the
    # launch-bound early stages finish their samples in seconds.
    "ladder_gpu": dict(requests=128, prompt=(64, 512), output=("uniform", 32, 256)),
    # The GPU tour's default: small enough that naive decoding (~30 tok/s on an H200: every token
    # launches every kernel of every layer) serves all of it in seconds, so no stage is extrapolated.
    "tour_gpu": dict(requests=16, prompt=(64, 256), output=("uniform", 16, 96)),
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


# Workloads that repeat themselves (chapter 11): the prefix cache only helps when requests
# begin with the same tokens.


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
