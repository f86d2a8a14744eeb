"""Turn each sequence's logits into its next token (chapter 7), with vLLM's sampling options
(chapter 10).

A row that needs more than an argmax goes through these steps, each a small function below,
in vLLM's order:

1. logprobs: log_softmax of the *raw* logits, if the request asked (what the model said,
   before anything below changed it; vLLM's default);
2. min_tokens: EOS and the stop tokens are made impossible until min_tokens are out;
3. penalties: repetition (tokens of the prompt or the output), then frequency and presence
   (tokens of the output);
4. greedy rows take the argmax here; the others are divided by their temperature,
5. lose the tokens below min_p times the top probability, then keep top_k and top_p
   (`filter_logits`),
6. and draw.

The common case skips all of it: when every row is greedy, with no penalty and no logprobs,
a step is one argmax and one copy of the token ids to the host.

Sampled rows draw their randomness from the request's own `torch.Generator`, seeded from
`SamplingParams.seed`, so a request's tokens do not depend on which other requests share the
step. To sample from probabilities p with a private generator we use the "exponential race":
draw E_i ~ Exp(1) for every token and pick argmax p_i / E_i, which picks token i with
probability exactly p_i (the same trick vLLM and nano-vllm use; it needs no cumulative sums).
"""
from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:  # sequence.py imports this module
    from minivllm.engine.sequence import Sequence

# Temperatures below this are greedy (vLLM's threshold): dividing logits by 1e-30 overflows
# to inf and the softmax of inf is NaN, while the distribution it stands for is the argmax.
GREEDY_BELOW = 1e-5


class RequestOutputKind(enum.Enum):
    """When the engine reports a request (vLLM's names). CUMULATIVE: every step that gives it
    a token, everything so far (for streaming); FINAL_ONLY: once, when it finishes (LLM.generate)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


def _integer(name: str, value: Any, low: int | None = None, high: int | None = None, none: bool = False) -> int | None:
    """value as an int in [low, high]; a bool, a float, a string or (unless none) None is refused."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer{' or None' if none else ''}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {'inf' if high is None else high}], got {value}")
    return int(value)


def _number(name: str, value: Any) -> float:
    """value as a finite float; a bool, a string, None or inf/NaN is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _items(name: str, value: Any, check) -> tuple:
    """A list or tuple (None: empty) with every item passed through check; a lone string, a
    dict or a set where a list belongs is refused."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise ValueError(f"{name} must be a list, got {type(value).__name__} {value!r}")
    return tuple(check(f"{name}[{i}]", item) for i, item in enumerate(value))


def _stop_string(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates: vLLM's SamplingParams, with its names, defaults and meanings.

    n: completions of the prompt, sampled independently (one RequestOutput with n outputs).
    temperature: 0 (or anything below 1e-5) is greedy; top_k: 0 or -1 keep every token;
    top_p: 1 keeps every token; min_p: drop tokens less likely than min_p x the top token.
    presence_penalty, frequency_penalty (in [-2, 2]): subtracted from the logit of every token
    the output already holds, once / once per occurrence; repetition_penalty (> 0, 1 = off):
    divides the positive (multiplies the negative) logits of every token of the prompt and
    the output. seed: makes the request reproducible (completion i uses seed + i).
    stop: strings that end the request; the text stops before them (include_stop_str_in_output
    keeps them) and the output's stop_reason names the one found. stop_token_ids end it like
    EOS, and stay in the output. ignore_eos: generate past EOS (benchmarks use it so every
    request produces exactly max_tokens). max_tokens: None means until the context is full;
    min_tokens: EOS and stop tokens cannot be sampled before this many tokens.
    logprobs: also report, for every output token, its log-probability and the top `logprobs`
    alternatives; prompt_logprobs: the same for the prompt's tokens (0: the token's own only).
    output_kind: see RequestOutputKind.

    Every field is checked when the params are made: a value of the wrong type (a float for
    an integer, a string for a number, None where None means nothing, a dict for a list) is a
    ValueError like a value out of range, never silently converted.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | Seq[str] | None = None
    stop_token_ids: Seq[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Greedy, nothing changes the logits, nothing to report: the sampler's fast path (min_tokens
    # is checked per sequence: it stops mattering once min_tokens are out). Worked out once
    # here, because the sampler asks for every row of every step.
    argmax_only: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:  # the dataclass is frozen: normalise in place once
            object.__setattr__(self, name, value)

        put("n", _integer("n", self.n, low=1))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            put(name, value)
        put("repetition_penalty", _number("repetition_penalty", self.repetition_penalty))
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 switches it off), got {self.repetition_penalty}")
        put("temperature", _number("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        put("top_p", _number("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        put("top_k", _integer("top_k", self.top_k, low=-1))  # -1 (vLLM) and 0 both switch it off
        put("min_p", _number("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        put("seed", _integer("seed", self.seed, low=-2**63, high=2**63 - 1, none=True))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        put("stop", _items("stop", stop, _stop_string))
        put("stop_token_ids", _items("stop_token_ids", self.stop_token_ids, lambda name, t: _integer(name, t, low=0)))
        put("include_stop_str_in_output", _flag("include_stop_str_in_output", self.include_stop_str_in_output))
        put("ignore_eos", _flag("ignore_eos", self.ignore_eos))
        put("max_tokens", _integer("max_tokens", self.max_tokens, low=1, none=True))
        put("min_tokens", _integer("min_tokens", self.min_tokens, low=0, high=self.max_tokens))
        put("logprobs", _integer("logprobs", self.logprobs, low=0, none=True))
        put("prompt_logprobs", _integer("prompt_logprobs", self.prompt_logprobs, low=0, none=True))
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.greedy and self.n > 1:
            raise ValueError(f"n must be 1 when sampling greedily (the {self.n} completions would be identical)")
        put("argmax_only", self.greedy and not self.penalised and self.logprobs is None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, in each row, the top_k largest logits (0 or -1 = all) and then the smallest set of
    the most likely tokens whose probabilities add up to at least top_p, probabilities taken
    from the softmax over the kept top_k; the rest become -inf. The most likely token always
    stays, and a row with top_k <= 0 and top_p = 1 is left unchanged (even where the float
    sum of its probabilities reaches 1 before its least likely tokens).

    logits: [S, V] (already divided by the temperature); top_k: [S] int; top_p: [S] float.
    Returns [S, V].
    """
    # BEGIN SOLUTION
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # A token is cut when the tokens ranked above it already reach top_p (the top one never is).
    mass_before = probs.cumsum(dim=-1) - probs
    cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    # END SOLUTION


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop (to -inf) every token whose probability is below min_p[s] times the probability
    of the row's most likely token. logits: [S, V]; min_p: [S] (0 keeps everything)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_penalties(
    logits: torch.Tensor, in_prompt: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
    frequency: torch.Tensor, repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's (and transformers') penalties. logits: [S, V]; in_prompt: [S, V] bool, the
    tokens of each row's prompt; counts: [S, V], how often each token is in its output so far;
    presence, frequency, repetition: [S].

    Repetition (CTRL's): a token seen in the prompt or the output has its logit divided by the
    penalty if positive, multiplied if negative (either way less likely for a penalty > 1).
    Frequency and presence (OpenAI's): subtract frequency x count and presence x (count > 0).
    """
    seen = in_prompt | (counts > 0)
    r = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def forbid_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """Set logits[rows[j], token_ids[j]] to -inf (min_tokens: EOS and stop tokens, too early)."""
    index = torch.tensor([rows, token_ids], device=logits.device)
    return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [S, V], row s drawn with generators[s] (see the module doc)."""
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):  # one Exp(1) row per request, from its own generator
        row.exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


class TopLogprobs(NamedTuple):
    """A position's log-probabilities: entry 0 is the token that was chosen (sampled, or the
    prompt's own), the rest the most likely tokens, best first. ranks: 1 = most likely."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """logprobs [R, V] (log_softmax of the raw logits), chosen [R] -> [3, R, 1 + k] float64:
    token ids, log-probabilities and ranks, the chosen token first, then the top k. Packed in
    one tensor so that it reaches the host in one copy (float64 holds the ids exactly)."""
    picked = logprobs.gather(1, chosen[:, None])  # [R, 1]
    rank = (logprobs > picked).sum(dim=-1, keepdim=True) + 1  # how many are strictly more likely, + 1
    values, ids = logprobs.topk(k, dim=-1)  # [R, k]
    ranks = torch.arange(1, k + 1, device=logprobs.device).expand(len(chosen), k)
    rows = [torch.cat([chosen[:, None], ids], 1), torch.cat([picked, values], 1), torch.cat([rank, ranks], 1)]
    return torch.stack([r.double() for r in rows])


def unpack_logprobs(packed: list, ks: list[int]) -> list[TopLogprobs]:
    """The host copy of top_logprobs' tensor, one TopLogprobs per row, row r cut to 1 + ks[r]."""
    ids, values, ranks = packed
    return [TopLogprobs([int(t) for t in ids[r][:k + 1]], values[r][:k + 1], [int(x) for x in ranks[r][:k + 1]])
            for r, k in enumerate(ks)]


class PenaltyCounts:
    """For each penalised sequence of the last step: the tokens of its prompt ([V] bool) and
    how often each token appears in its output ([V] int), on the device, one row each.

    Counting a sequence's tokens from its lists costs its length; doing it every step would
    make a step's cost grow with every token of the batch. So a sequence is counted from its
    lists once, when it joins the penalised rows, and afterwards each step adds the tokens it
    sampled with one scatter for the whole batch. A sequence that misses a step (preempted,
    out of budget) leaves the table and is counted afresh when it comes back.
    """

    def __init__(self) -> None:
        self.row_of: dict[Sequence, int] = {}
        self.in_prompt: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def gather(self, seqs: list[Sequence], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_prompt, counts) [len(seqs), V] for these sequences, in this order."""
        old = [self.row_of.get(seq, -1) for seq in seqs]
        # Index pairs (row, token) of the newcomers' prompt and output tokens, all in one buffer.
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        output_rows: list[int] = []
        output_ids: list[int] = []
        for row, (seq, j) in enumerate(zip(seqs, old)):
            if j < 0:
                prompt_rows += [row] * seq.num_prompt_tokens
                prompt_ids += seq.prompt_token_ids
                output_rows += [row] * seq.num_output_tokens
                output_ids += seq.output_token_ids
        flat = torch.tensor(old + prompt_rows + prompt_ids + output_rows + output_ids, device=device)
        old_rows, p_rows, p_ids, o_rows, o_ids = flat.split(
            [len(old), len(prompt_rows), len(prompt_ids), len(output_rows), len(output_ids)])
        if self.counts is None:
            in_prompt = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device)
            counts = torch.zeros(len(seqs), vocab, dtype=torch.int32, device=device)
        else:  # the returning rows from the table, zeros for the newcomers
            known = (old_rows >= 0)[:, None]
            in_prompt = self.in_prompt[old_rows.clamp(min=0)] & known
            counts = self.counts[old_rows.clamp(min=0)] * known
        in_prompt[p_rows, p_ids] = True
        counts.index_put_((o_rows, o_ids), torch.ones_like(o_ids, dtype=torch.int32), accumulate=True)
        self.row_of = {seq: row for row, seq in enumerate(seqs)}
        self.in_prompt, self.counts = in_prompt, counts
        return in_prompt, counts

    def add(self, tokens: torch.Tensor) -> None:
        """Count the tokens the last gathered rows sampled (tokens [rows], on the device)."""
        rows = torch.arange(len(tokens), device=tokens.device)
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def clear(self) -> None:
        self.row_of, self.in_prompt, self.counts = {}, None, None


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TopLogprobs | None]  # one per row: None where the request did not ask


class Sampler:
    """Chooses every row's next token (see the module doc). Its one piece of state is the
    penalised sequences' token counts, kept from step to step (PenaltyCounts)."""

    def __init__(self) -> None:
        self.penalty_counts = PenaltyCounts()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> SamplerOutput:
        """logits [S, V]: row s is seqs[s]'s prediction of its next token."""
        tokens = logits.argmax(dim=-1)  # right for every row that is greedy and nothing else
        rows = [s for s, seq in enumerate(seqs)
                if not seq.params.argmax_only or (seq.params.min_tokens and too_early_to_stop(seq))]
        logprobs: list[TopLogprobs | None] = [None] * len(seqs)
        if not any(seqs[s].params.penalised for s in rows):  # penalised rows are always among them
            self.penalty_counts.clear()
        if rows:
            picked = [seqs[s] for s in rows]
            chosen, picked_logprobs = self.sample_rows(logits if len(rows) == len(seqs) else logits[rows], picked,
                                                       eos_token_ids)
            if len(rows) == len(seqs):
                tokens = chosen
            else:
                tokens[rows] = chosen
            for s, top in zip(rows, picked_logprobs):
                logprobs[s] = top
        return SamplerOutput(tokens.tolist(), logprobs)

    def sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
    ) -> tuple[torch.Tensor, list[TopLogprobs | None]]:
        """The full pipeline, for the rows that need it. Returns the chosen tokens [S] (on the
        device) and each row's logprobs (None where not asked)."""
        params = [seq.params for seq in seqs]
        device = logits.device
        x = logits.float()  # in fp32 even for bf16 models (a copy only if the model is not fp32)
        asking = [s for s, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = x[asking].log_softmax(dim=-1) if asking else None
        # Every row's settings in one host buffer and one copy to the device.
        settings = torch.tensor([[p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
                                  p.repetition_penalty] for p in params]).to(device)
        temperature, top_p, top_k, min_p, presence, frequency, repetition = settings.unbind(1)

        rows, token_ids = stop_tokens_too_early(seqs, eos_token_ids)
        if rows:
            x = forbid_tokens(x, rows, token_ids)
        penalised = [s for s, p in enumerate(params) if p.penalised]
        if penalised:
            in_prompt, counts = self.penalty_counts.gather([seqs[s] for s in penalised], x.shape[-1], device)
            pick = torch.tensor(penalised, device=device)
            x = x.index_put((pick,), apply_penalties(x[pick], in_prompt, counts, presence[pick], frequency[pick],
                                                     repetition[pick]))

        chosen = x.argmax(dim=-1)  # the greedy rows' answer
        drawn = [s for s, p in enumerate(params) if not p.greedy]
        if drawn:
            pick = torch.tensor(drawn, device=device)
            scaled = x[pick] / temperature[pick, None]
            if any(params[s].min_p > 0 for s in drawn):
                scaled = apply_min_p(scaled, min_p[pick])
            if any(params[s].top_k > 0 or params[s].top_p < 1 for s in drawn):
                scaled = filter_logits(scaled, top_k[pick].long(), top_p[pick])
            tokens = exponential_race(scaled.softmax(dim=-1), [seqs[s].generator for s in drawn])
            chosen = chosen.index_put((pick,), tokens)
        if penalised:
            self.penalty_counts.add(chosen[penalised])

        logprobs: list[TopLogprobs | None] = [None] * len(seqs)
        if asking:
            ks = [params[s].logprobs for s in asking]
            packed = top_logprobs(raw_logprobs, chosen[asking], max(ks)).tolist()  # the one extra copy to the host
            for s, top in zip(asking, unpack_logprobs(packed, ks)):
                logprobs[s] = top
        return chosen, logprobs


def too_early_to_stop(seq: Sequence) -> bool:
    """Whether min_tokens still forbids this sequence's EOS and stop tokens."""
    return seq.num_output_tokens < seq.params.min_tokens


def stop_tokens_too_early(seqs: list[Sequence], eos_token_ids: set[int]) -> tuple[list[int], list[int]]:
    """(rows, token ids) pairs to forbid: EOS (unless ignored) and the stop tokens of every
    sequence that has fewer than min_tokens output tokens."""
    rows: list[int] = []
    token_ids: list[int] = []
    for s, seq in enumerate(seqs):
        if too_early_to_stop(seq):
            forbidden = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else eos_token_ids)
            rows += [s] * len(forbidden)
            token_ids += sorted(forbidden)
    return rows, token_ids
