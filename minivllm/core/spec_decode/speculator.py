"""What LLMEngine.step does differently with speculation on (chapter 12), in the order it happens:

1. propose   every running sequence that is decoding gets up to k guesses, appended to its
             token_ids (seq.num_spec_tokens counts them). To the scheduler a sequence with D
             guesses is a sequence with 1 + D tokens to compute: a chunk, like chapter 5's.
2. fit       after scheduling, guesses that did not fit the step (a smaller grant, a
             preemption, no grant at all) are dropped, so every chunk ends at its last guess.
3. (the model runs; the runner returns logits for the last 1 + D rows of each such chunk)
4. verify    rejection sampling keeps a prefix of the guesses and draws one more token.
5. rollback  the guesses leave token_ids, the computed-token count drops by the rejected ones,
             and the blocks that held only rejected guesses go back to the pool.
Then the engine appends the accepted guesses and the drawn token one at a time, so stop tokens,
stop strings and max_tokens end a request exactly where plain decoding would.

A sequence speculates only where exactness is simple: not while min_tokens still forbids its
stop tokens, and not with penalties (both depend on the tokens before each position); those
requests decode one token at a time. Under a grammar (chapter 13) each verify row is masked as
the grammar stands after the guesses before it (`mask_guesses`); a request's logit_bias,
allowed_token_ids and bad_words edit every verify row as the sampler would edit that position's
row (bad words after the guesses before it), so the target distribution p is the one plain
decoding samples from. Guesses never run past max_tokens or the context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.config.engine import EngineConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.core.block_manager import BlockManager
from minivllm.core.spec_decode.draft_model import DraftModelProposer
from minivllm.core.spec_decode.ngram import NgramProposer
from minivllm.core.spec_decode.rejection import rejection_sample, target_probs
from minivllm.core.spec_decode.rollback import rollback
from minivllm.model import Decoder
from minivllm.request.logprobs import TopLogprobs, report_logprobs
from minivllm.request.messages import SpecDecodeStats
from minivllm.request.sequence import SchedulerOutput, Sequence
from minivllm.structured_outputs.bitmask import apply_token_bitmask, num_words
from minivllm.worker.logit_bias import verify_pasts
from minivllm.worker.sampler import Sampler, draw_rows


@dataclass
class Verified:
    """One sequence's verdict: the tokens to append (accepted guesses, then the drawn one), each
    token's logprobs (None where the request did not ask), and how many guesses there were."""

    token_ids: list[int]
    logprobs: list[TopLogprobs | None]
    num_guesses: int


def mask_guesses(logits: torch.Tensor, seqs: list[Sequence], starts: list[int]) -> None:
    """Chapter 13 under chapter 12: the verify rows of a sequence under a grammar lose, in place,
    the tokens its grammar forbids at that row's place: row j's mask comes from the matcher after
    it has taken guesses 1..j, and then the matcher goes back to where it was (its invariant:
    it has accepted exactly the sequence's output tokens). Rows after a guess the grammar refuses
    stay as they are: that guess has probability 0 in its own row, so it is rejected and they are
    never used. starts[s]: the first of seqs[s]'s rows in logits."""
    rows, masks = [], []
    for seq, start in zip(seqs, starts):
        if seq.grammar is None:
            continue
        matcher, guesses = seq.grammar.matcher, seq.token_ids[len(seq.token_ids) - seq.num_spec_tokens:]
        bitmask = torch.empty(len(guesses) + 1, num_words(logits.shape[-1]), dtype=torch.int32)
        taken = filled = 0
        while not matcher.is_terminated():  # a grammar that has ended allows nothing: its rows are never used
            matcher.fill_next_token_bitmask(bitmask, filled)
            rows.append(start + filled)
            filled += 1
            if taken == len(guesses) or not matcher.accept_token(guesses[taken]):
                break
            taken += 1
        masks.append(bitmask[:filled])
        if taken:
            matcher.rollback(taken)
    if rows:
        apply_token_bitmask(logits, torch.cat(masks), rows)


def may_speculate(seq: Sequence) -> bool:
    """Decoding (its newest token is all it has left to compute), and nothing about its next
    token depends on the tokens before it in a way the verify chunk would not see."""
    return (seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_output_tokens > 0
            and not seq.params.penalised and seq.num_output_tokens >= seq.params.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, target: Decoder, engine: EngineConfig, sampler: Sampler):
        """sampler: the engine's, whose generator draws for the requests without a seed of their own."""
        self.config, self.sampler = config, sampler
        self.proposer = (NgramProposer(config) if config.method == "ngram"
                         else DraftModelProposer(config, target, engine, sampler))
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.pause_at = config.pause_at(target.device)  # disable_by_batch_size, resolved for the device
        self.draft_probs: dict[Sequence, torch.Tensor] = {}  # q of each sequence's guesses, this step

    def propose(self, running: list[Sequence]) -> None:
        """Step 1: append guesses to every running sequence that may speculate (none while the
        batch is at least disable_by_batch_size: it has no spare compute to verify them with)."""
        pause = self.pause_at
        if pause is not None and len(running) >= pause:
            return
        seqs = [seq for seq in running if may_speculate(seq)]
        limits = [min(self.config.num_speculative_tokens, seq.max_total_tokens - seq.num_tokens) for seq in seqs]
        guesses, dists = self.proposer.propose(seqs, limits)
        for seq, tokens, q in zip(seqs, guesses, dists or [None] * len(seqs)):
            seq.token_ids += tokens
            seq.num_spec_tokens = len(tokens)
            if q is not None:
                self.draft_probs[seq] = q

    def fit(self, schedule: SchedulerOutput, running: list[Sequence], waiting: list[Sequence]) -> None:
        """Step 2: keep only the guesses each sequence's grant covers; none for the others."""
        granted = dict(zip(schedule.seqs, schedule.num_new_tokens))
        for seq in [*running, *waiting]:
            if seq.num_spec_tokens == 0:
                continue
            real_left = seq.num_tokens - seq.num_spec_tokens - seq.num_computed_tokens  # tokens before its guesses
            keep = max(0, min(seq.num_spec_tokens, granted.get(seq, 0) - real_left))
            del seq.token_ids[len(seq.token_ids) - (seq.num_spec_tokens - keep):]
            seq.num_spec_tokens = keep
            if seq in self.draft_probs:
                if keep:
                    self.draft_probs[seq] = self.draft_probs[seq][:keep]
                else:
                    del self.draft_probs[seq]

    def verify(self, logits: torch.Tensor, seqs: list[Sequence], block_manager: BlockManager) -> list[Verified]:
        """Steps 4 and 5 for sequences that ran a verify chunk: logits holds 1 + D_s rows for
        each, in order (the rows of its last real token and of every guess)."""
        S, K = len(seqs), max(seq.num_spec_tokens for seq in seqs)
        V, device = logits.shape[-1], logits.device
        probs = torch.zeros(S, K + 1, V, device=device)
        drafts = torch.full((S, K), -1, dtype=torch.long, device=device)
        q = None if not any(seq in self.draft_probs for seq in seqs) else torch.zeros(S, K, V, device=device)
        starts, start = [], 0
        for seq in seqs:
            starts.append(start)
            start += seq.num_spec_tokens + 1
        mask_guesses(logits, seqs, starts)  # chapter 13: each row as its grammar allows it, after the guesses before it
        for s, seq in enumerate(seqs):
            D, start = seq.num_spec_tokens, starts[s]
            pasts = verify_pasts(seq.token_ids, seq.num_prompt_tokens, D, seq.params)  # for bad_words
            probs[s, :D + 1] = target_probs(logits[start:start + D + 1], seq.params, pasts)
            drafts[s, :D] = torch.tensor(seq.token_ids[-D:], device=device)
            if q is not None:  # a certain guess (greedy, or a lookup) is a one-hot q
                q[s, :D] = self.draft_probs.get(seq, probs.new_zeros(D, V).scatter_(1, drafts[s, :D, None], 1.0))
        generators, shared = [seq.generator for seq in seqs], self.sampler.shared_generator(device)
        uniforms = draw_rows(torch.empty(S, K, device=device), "uniform_", generators, shared)
        noise = draw_rows(torch.empty(S, V, device=device), "exponential_", generators, shared)
        num_drafts = torch.tensor([seq.num_spec_tokens for seq in seqs], device=device)
        tokens, accepted = rejection_sample(probs, drafts, num_drafts, q, uniforms, noise)
        tokens, accepted = tokens.tolist(), accepted.tolist()
        asking = any(seq.params.logprobs is not None for seq in seqs)
        raw = logits.float().log_softmax(dim=-1) if asking else None  # only for requests that report logprobs
        verdicts = []
        for s, seq in enumerate(seqs):
            out = tokens[s][:accepted[s] + 1]
            tops: list[TopLogprobs | None] = [None] * len(out)
            if seq.params.logprobs is not None:
                rows = raw[starts[s]:starts[s] + len(out)]
                tops = report_logprobs(rows, torch.tensor(out, device=device), [seq.params.logprob_columns] * len(out))
            verdicts.append(Verified(out, tops, seq.num_spec_tokens))
            self.stats.add(seq.num_spec_tokens, accepted[s])
            rollback(seq, seq.num_spec_tokens - accepted[s], block_manager)
            self.draft_probs.pop(seq, None)
        return verdicts
