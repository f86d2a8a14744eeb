"""Turn each sequence's logits into its next token (chapter 7), with vLLM's sampling options
(chapter 10).

First, chapter 13: the rows of requests with structured_outputs lose every token their grammar
forbids (`structured_outputs.bitmask.constrain_logits`, in place), so everything below, the
argmax included, only ever sees allowed tokens.

A row that needs more than an argmax goes through these steps, each a small function below,
in vLLM's order:

1. logprobs: log_softmax of the *raw* logits, if the request asked (what the model said,
   before anything below changed it, apart from a grammar's mask; vLLM's default), reported
   as the top k alternatives or, with logprob_token_ids, the listed tokens';
2. the request's own edits (logit_bias.py): allowed_token_ids, bad_words, logit_bias;
3. min_tokens: EOS and the stop tokens are made impossible until min_tokens are out;
4. penalties: repetition (tokens of the prompt or the output), then frequency and presence
   (tokens of the output);
5. greedy rows take the argmax here; the others are divided by their temperature,
6. lose the tokens below min_p times the top probability, then keep top_k and top_p
   (`filter_logits`),
7. and draw.

The common case skips all of it: when every row is greedy, with no penalty, no edits of its
own and no logprobs, a step is one argmax and one copy of the token ids to the host.

To sample from probabilities p we use the "exponential race": draw E_i ~ Exp(1) for every
token and pick argmax p_i / E_i, which picks token i with probability exactly p_i (the same
trick vLLM and nano-vllm use; it needs no cumulative sums). The noise for every sampled row of
the step comes from one draw of the sampler's own generator, one launch however many rows.
A request with a `SamplingParams.seed` draws its row from a `torch.Generator` of its own
instead (seeded from it, one row per step), so its tokens do not depend on which other
requests share the step; the rows without a seed are free to share one draw.

What reaches the device (the rows' settings, which rows to pick) goes from pinned host memory
in non-blocking copies (worker/prepare.py's to_device), so sampling never makes the host wait
for the GPU; only reading the chosen tokens back does.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.request.logprobs import TopLogprobs, report_logprobs
from minivllm.request.sequence import Sequence
from minivllm.structured_outputs.bitmask import constrain_logits
from minivllm.worker.logit_bias import bias_logits, recent_output
from minivllm.worker.penalties import PenaltyCounts, apply_penalties
from minivllm.worker.prepare import to_device


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, in each row, the top_k largest logits (0 or -1 = all) and then the smallest set of
    the most likely tokens whose probabilities add up to at least top_p, probabilities taken
    from the softmax over the kept top_k; the rest become -inf, the kept logits stay as they
    were. So the token whose probability carries the running sum across top_p is kept. The
    most likely token always stays, and a row with top_k <= 0 and top_p = 1 is left unchanged
    (even where the float sum of its probabilities reaches 1 before its least likely tokens).
    Ties: every token whose logit equals the k-th largest stays, so a row may keep more than
    top_k tokens (as in vLLM); among tokens of equal probability where the sum crosses top_p,
    which of them stay is not specified.

    logits: [S, V] (already divided by the temperature); top_k: [S] int; top_p: [S] float.
    Returns [S, V].
    """
    # BEGIN SOLUTION
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=logits.shape[-1]), logits.shape[-1])[:, None]
    kth_largest = sorted_logits.gather(-1, k - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))  # ties with it stay
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


def indices(values: list[int], device: torch.device) -> torch.Tensor:
    """A list of ints as an int64 tensor on `device`, copied without making the host wait."""
    return to_device(np.array(values, dtype=np.int64), device)


def forbid_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """Set logits[rows[j], token_ids[j]] to -inf (min_tokens: EOS and stop tokens, too early)."""
    index = indices(rows + token_ids, logits.device).view(2, -1)
    out = logits.clone()
    out[index[0], index[1]] = float("-inf")
    return out


def draw_rows(out: torch.Tensor, fill: str, generators: list[torch.Generator | None],
              shared: torch.Generator | None = None) -> torch.Tensor:
    """Fill `out` [S, ...] in place with random draws, `fill` a tensor method such as
    "exponential_" or "uniform_": row s from generators[s] when it has one (a seeded request),
    every other row from one draw of `shared` (None: PyTorch's default generator). Returns out."""
    seeded = [(row, generator) for row, generator in enumerate(generators) if generator is not None]
    if len(seeded) < len(generators):
        getattr(out, fill)(generator=shared)  # every row at once; seeded rows are redrawn below
    for row, generator in seeded:
        getattr(out[row], fill)(generator=generator)
    return out


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None],
                     shared: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs [S, V] (see the module doc). Row s's noise comes from
    generators[s] when it has one (a seeded request), else from one draw of `shared` for all
    such rows (None: PyTorch's default generator)."""
    noise = draw_rows(torch.empty_like(probs), "exponential_", generators, shared)
    return (probs / noise).argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TopLogprobs | None]  # one per row: None where the request did not ask


class Sampler:
    """Chooses every row's next token (see the module doc). Its state: the penalised sequences'
    token counts, kept from step to step (PenaltyCounts), and the generator of the rows without
    a seed (made on the logits' device at the first sampled step, from a random seed)."""

    def __init__(self) -> None:
        self.penalty_counts = PenaltyCounts()
        self.generator: torch.Generator | None = None

    def shared_generator(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device).manual_seed(random.SystemRandom().getrandbits(63))
        return self.generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> SamplerOutput:
        """logits [S, V]: row s is seqs[s]'s prediction of its next token."""
        tokens, logprobs = self.sample(logits, seqs, eos_token_ids)
        return SamplerOutput(tokens.tolist(), logprobs)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]
               ) -> tuple[torch.Tensor, list[TopLogprobs | None]]:
        """As __call__, with the tokens [S] left on the device (chapter 16 feeds them to the next step there)."""
        constrain_logits(logits, [seq.grammar for seq in seqs])  # chapter 13: forbidden tokens -> -inf, in place
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
                tokens[indices(rows, tokens.device)] = chosen
            for s, top in zip(rows, picked_logprobs):
                logprobs[s] = top
        return tokens, logprobs

    def sample_rows(
        self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int],
    ) -> tuple[torch.Tensor, list[TopLogprobs | None]]:
        """The full pipeline, for the rows that need it. Returns the chosen tokens [S] (on the
        device) and each row's logprobs (None where not asked)."""
        params = [seq.params for seq in seqs]
        device = logits.device
        x = logits.float()  # in fp32 even for bf16 models (a copy only if the model is not fp32)
        asking = [s for s, p in enumerate(params) if p.logprobs is not None]
        asking_rows = indices(asking, device) if asking else None
        raw_logprobs = x[asking_rows].log_softmax(dim=-1) if asking else None
        # Every row's settings in one host buffer and one copy to the device.
        settings = to_device(np.array([[p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty,
                                        p.frequency_penalty, p.repetition_penalty] for p in params], dtype=np.float32),
                             device)
        temperature, top_p, top_k, min_p, presence, frequency, repetition = settings.unbind(1)

        if any(p.edits_logits for p in params):
            x = bias_logits(x, params, [recent_output(seq.token_ids, seq.num_prompt_tokens, seq.params) for seq in seqs])
        rows, token_ids = stop_tokens_too_early(seqs, eos_token_ids)
        if rows:
            x = forbid_tokens(x, rows, token_ids)
        penalised = [s for s, p in enumerate(params) if p.penalised]
        if penalised:
            in_prompt, counts = self.penalty_counts.gather([seqs[s] for s in penalised], x.shape[-1], device)
            penalised_rows = indices(penalised, device)
            x = x.index_put((penalised_rows,), apply_penalties(x[penalised_rows], in_prompt, counts,
                                                               presence[penalised_rows], frequency[penalised_rows],
                                                               repetition[penalised_rows]))

        chosen = x.argmax(dim=-1)  # the greedy rows' answer
        drawn = [s for s, p in enumerate(params) if not p.greedy]
        if drawn:
            every_row = len(drawn) == len(params)  # the common case: no row to pick out
            pick = None if every_row else indices(drawn, device)
            scaled = (x / temperature[:, None]) if every_row else x[pick] / temperature[pick, None]
            if any(params[s].min_p > 0 for s in drawn):
                scaled = apply_min_p(scaled, min_p if every_row else min_p[pick])
            if any(params[s].top_k > 0 or params[s].top_p < 1 for s in drawn):
                scaled = filter_logits(scaled, (top_k if every_row else top_k[pick]).long(),
                                       top_p if every_row else top_p[pick])
            tokens = exponential_race(scaled.softmax(dim=-1), [seqs[s].generator for s in drawn],
                                      self.shared_generator(device))
            chosen = tokens if every_row else chosen.index_put((pick,), tokens)
        if penalised:
            self.penalty_counts.add(chosen[penalised_rows])

        logprobs: list[TopLogprobs | None] = [None] * len(seqs)
        if asking:
            wanted = [params[s].logprob_columns for s in asking]  # top k, or logprob_token_ids
            for s, top in zip(asking, report_logprobs(raw_logprobs, chosen[asking_rows], wanted)):
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
