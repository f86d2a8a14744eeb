"""A small model with the target's vocabulary guesses the next tokens (chapter 12).

The draft is a whole second engine in miniature: its own model runner (the same paged attention,
and on a GPU the same CUDA graphs), its own KV pool and block manager, and for every target
sequence a shadow Sequence of its own. Each step it first *catches up*: the target has appended
tokens since the draft last looked (the accepted guesses and the token the target drew), so the
draft computes them as one chunk per sequence, all sequences in one ragged batch, and from the
last one's logits takes its first guess. Then it feeds each guess back to get the next, k
single-token steps in all. A guess the target later rejects is rolled back here too: the shadow
keeps only the K/V of tokens the target really has.

Guesses are the draft's argmax for greedy requests (certain: q is one-hot) and are drawn from
the draft's softmax at the request's temperature otherwise (q is that softmax, which the
rejection sampler needs).

Under a grammar (chapter 13) the draft guesses as the target samples: each of its rows loses
the tokens the grammar forbids after the guesses before it (`mask_draft_rows`), so it never
spends a guess on a token the target's masked verify row would reject for certain, and q is the
masked softmax. The request's matcher walks along its guesses and is rolled back at the end:
its invariant (it has accepted exactly the sequence's output tokens) holds between steps.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from minivllm.config.engine import EngineConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.core.block_manager import BlockManager
from minivllm.core.prefix_cache import PrefixCachingBlockManager
from minivllm.loader import load_model
from minivllm.model import Decoder
from minivllm.request.sampling_params import SamplingParams
from minivllm.request.sequence import SchedulerOutput, Sequence, Status
from minivllm.structured_outputs.bitmask import apply_token_bitmask, num_words
from minivllm.worker.model_runner import ModelRunner
from minivllm.worker.sampler import Sampler


def load_draft(source: Any, target: Decoder) -> Decoder:
    """The draft model on the target's device and dtype, refused (ValueError) unless it speaks
    the target's vocabulary: a guess is a token id, and both models must mean the same token."""
    draft = source if isinstance(source, Decoder) else load_model(source, device=str(target.device), dtype=target.dtype)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                         f"({target.config.vocab_size}): its guesses would be other tokens")
    if (draft.device, draft.dtype) != (target.device, target.dtype):
        raise ValueError(f"the draft model is on {draft.device} in {draft.dtype}; the target on {target.device} in "
                         f"{target.dtype}: load the draft like the target")
    return draft


@torch.inference_mode()  # the logits come from the runner's inference mode: only there may they change in place
def mask_draft_rows(logits: torch.Tensor, targets: list[Sequence]) -> None:
    """Chapter 13 in the draft: row i of logits [len(targets), V] loses, in place, every token
    targets[i]'s grammar forbids where its matcher stands now (after the guesses made so far
    this step); rows of requests without a grammar stay as they are."""
    rows = [i for i, target in enumerate(targets) if target.grammar is not None]
    if not rows:
        return
    bitmask = torch.empty(len(rows), num_words(logits.shape[-1]), dtype=torch.int32)
    for r, i in enumerate(rows):
        targets[i].grammar.matcher.fill_next_token_bitmask(bitmask, r)
    apply_token_bitmask(logits, bitmask, rows)


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, target: Decoder, engine: EngineConfig, sampler: Sampler):
        """engine: the target engine's resolved config, which the draft follows (block size,
        attention, graphs, fused ops, batch size). Its pool holds what the target's can, plus
        room for k more tokens per running sequence (the guesses' K/V). sampler: the engine's,
        whose generator draws the guesses of requests without a seed of their own."""
        self.k, self.sampler = config.num_speculative_tokens, sampler
        self.model = load_draft(config.model, target)
        if self.model.config.max_position_embeddings < engine.max_model_len:
            raise ValueError(f"the draft model's context ({self.model.config.max_position_embeddings} tokens) is "
                             f"shorter than the engine's max_model_len ({engine.max_model_len})")
        extra = engine.max_num_seqs * (-(-self.k // engine.block_size) + 1)
        draft_engine = dataclasses.replace(engine, num_kv_blocks=engine.num_kv_blocks + extra)
        # Its steps replay graphs as the target's do (on a GPU): after its first step a draft
        # sequence catches up on at most 2 tokens (the guess before the target's bonus token and
        # that token; 1 after a rejection), then feeds its guesses back one at a time.
        self.runner = ModelRunner(self.model, draft_engine, graph_query_lens=(1, 2))
        # The draft shares prefixes as the target does (n completions of a prompt, a system
        # prompt): without that it would need more blocks than the target for the same requests.
        manager = PrefixCachingBlockManager if engine.enable_prefix_caching else BlockManager
        self.blocks = manager(draft_engine.num_kv_blocks, engine.block_size)
        self.shadows: dict[Sequence, Sequence] = {}  # target sequence -> the draft's copy of it

    def propose(self, targets: list[Sequence], limits: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Guesses for each target sequence (at most limits[i]; those with limit 0 get none),
        and for each the draft distributions q [guesses, V] they were drawn from (None for a
        greedy request: its guesses are certain)."""
        self._forget_stopped()
        # A grammar that has ended allows no token at all: nothing to guess.
        active = [(t, self._shadow(t), limit) for t, limit in zip(targets, limits)
                  if limit > 0 and (t.grammar is None or not t.grammar.matcher.is_terminated())]
        guesses: dict[Sequence, list[int]] = {t: [] for t, _, _ in active}
        dists: dict[Sequence, list[torch.Tensor]] = {t: [] for t, _, _ in active}
        for _ in range(max((limit for _, _, limit in active), default=0)):
            step, schedule = [], SchedulerOutput()
            for target, shadow, limit in active:
                n = shadow.num_tokens - shadow.num_computed_tokens  # the catch-up chunk, then one guess at a time
                ended = target.grammar is not None and target.grammar.matcher.is_terminated()  # by a guess
                if (len(guesses[target]) < limit and not ended
                        and self.blocks.can_grow(shadow.block_table, shadow.num_computed_tokens + n)):
                    self.blocks.grow(shadow.block_table, shadow.num_computed_tokens + n)
                    schedule.add(shadow, n)
                    step.append((target, shadow))  # a draft out of blocks just guesses less: never an error
            if not step:
                break
            _, logits, _ = self.runner.run(schedule)  # every shadow ends its chunk: one row each
            mask_draft_rows(logits, [target for target, _ in step])
            for (target, shadow), n, row in zip(step, schedule.num_new_tokens, logits):
                shadow.num_computed_tokens += n
                token, q = self._guess(row, target.params, target.generator or self.sampler.shared_generator(row.device))
                shadow.token_ids.append(token)
                guesses[target].append(token)
                if target.grammar is not None and not target.grammar.matcher.accept_token(token):
                    raise RuntimeError(f"the grammar refused the draft's guess {token}, drawn from a row it had masked")
                if q is not None:
                    dists[target].append(q)
        for target, tokens in guesses.items():  # the matchers back where they were: at the output tokens
            if target.grammar is not None and tokens:
                target.grammar.matcher.rollback(len(tokens))
        return ([guesses.get(t, []) for t in targets],
                [torch.stack(dists[t]) if dists.get(t) else None for t in targets])

    def _shadow(self, target: Sequence) -> Sequence:
        """The draft's copy of target, brought up to date: it keeps the K/V of the longest prefix
        it shares with the target's tokens now (its own rejected guesses are rolled back)."""
        tokens = target.token_ids[:target.num_tokens - target.num_spec_tokens]
        shadow = self.shadows.get(target)
        if shadow is None:
            shadow = Sequence(target.request_id, tokens, SamplingParams(), target.max_model_len)
            shadow.status = Status.RUNNING
            shadow.num_computed_tokens = self.blocks.reuse_prefix(shadow)  # cached blocks, as chapter 11's admission
            self.shadows[target] = shadow
        else:
            same = 0
            limit = min(shadow.num_computed_tokens, len(tokens))
            while same < limit and shadow.token_ids[same] == tokens[same]:
                same += 1
            shadow.token_ids = list(tokens)
            shadow.num_computed_tokens = same
            self.blocks.shrink(shadow.block_table, same)
        if shadow.num_computed_tokens == shadow.num_tokens:  # keep the last token to compute: its logits guess
            shadow.num_computed_tokens -= 1
        return shadow

    def _guess(self, logits: torch.Tensor, params: SamplingParams, generator: Any) -> tuple[int, torch.Tensor | None]:
        if params.greedy:
            return int(logits.argmax()), None
        q = (logits.float() / params.temperature).softmax(dim=-1)
        noise = torch.empty_like(q).exponential_(generator=generator)
        return int((q / noise).argmax()), q

    def _forget_stopped(self) -> None:
        """Free the shadows of sequences that stopped running (finished, aborted, preempted)."""
        for target in [t for t in self.shadows if t.status is not Status.RUNNING]:
            self.forget(target)

    def forget(self, target: Sequence) -> None:
        shadow = self.shadows.pop(target, None)
        if shadow is not None:
            self.blocks.release(shadow.block_table)
