"""Chapter 4 — ragged batching: no padding, one flat run of tokens per step.

Static batching computes a rectangle, and much of it is padding or finished rows. Here a step
lays the tokens each live sequence needs (its whole prompt in prefill, one token in decode)
end to end in one flat run of T tokens. `cu_seqlens` (cumulative sequence lengths, the name
flash-attn and vLLM use) marks the segments: sequence i owns tokens cu[i] .. cu[i+1]-1.

Everything in the model but attention is per token, so it runs on the flat run unchanged.
Attention must keep the segments apart. As one dense mask that is the block-diagonal causal
mask [T, T] (masks.block_diagonal_mask: the picture, and a reference in the tests), but it
costs T^2 memory and computes scores between sequences only to hide them. So we attend
segment by segment instead, each against its own sequence's KV cache (chapter 2's KVCache).
A sequence that finishes leaves the batch at once: no slot is ever wasted.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from minivllm.attention.dense import attend
from minivllm.attention.masks import causal_mask
from minivllm.model import Decoder
from minivllm.stages.common import StageStats, as_tensor, prepare
from minivllm.stages.kv_cache import KVCache, append_kv


def cu_seqlens(lengths: list[int]) -> list[int]:
    """Offsets of segments laid end to end: a list of len(lengths) + 1 ints, [0, n0, n0 + n1,
    ..., T] with T = sum(lengths) (no lengths: [0]). Segment i is the flat tokens
    cu[i] .. cu[i+1]-1. RaggedAttention refuses any other list with a ValueError."""
    # BEGIN SOLUTION
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets
    # END SOLUTION


@dataclass
class Segment:
    """One sequence's share of a step: `num_new` query tokens that come after the `past`
    tokens already in its own `cache`. Here a prefill segment has past = 0 and a decode segment
    has num_new = 1; chapter 5 allows both at once (a chunk in the middle of a prompt)."""

    cache: KVCache
    past: int
    num_new: int


class RaggedAttention:
    """The flat run is segments end to end; each attends only to its own sequence's cache."""

    def __init__(self, segments: list[Segment]):
        self.segments = segments
        lengths = [s.num_new for s in segments]
        self.cu = cu_seqlens(lengths)
        # Offsets that drop or shift a segment would leave a sequence without its next token,
        # and the stage waiting for it forever: refuse them here, where the cause is plain.
        if not (isinstance(self.cu, list) and self.cu[:1] == [0]
                and [b - a for a, b in zip(self.cu, self.cu[1:])] == lengths):
            raise ValueError(f"cu_seqlens({lengths}) returned {self.cu!r}: expected a list of {len(lengths) + 1} "
                             f"offsets from 0 to {sum(lengths)}, consecutive ones differing by the lengths")
        self.masks = [self.mask(s) for s in segments]  # built once, used by every layer

    def mask(self, segment: Segment) -> torch.Tensor | None:
        """Prefill (past = 0): causal within the prompt. Decode: one query that may see its
        whole cache, so no mask at all."""
        return causal_mask(segment.num_new, segment.cache.k.device) if segment.num_new > 1 else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's attention over the step's flat run: q [T, Hq, D], k and v [T, Hkv, D],
        T = self.cu[-1]; returns [T, Hq, D], row t for query t.

        Segment i (self.segments[i], flat rows self.cu[i]..self.cu[i+1]-1) first writes its k
        and v rows into its own cache, at rows past..past+num_new-1 of segment.cache.k[layer]
        and segment.cache.v[layer] (chapter 2's append_kv); then its queries attend to that
        cache's rows 0..past+num_new-1 with self.masks[i] (chapter 1's attend; a mask of None
        lets every query see every key). Segments never see each other and no [T, T] matrix is
        built. Leave cache.length alone: the stage moves it on once every layer has run."""
        # BEGIN SOLUTION
        out = torch.empty_like(q)
        for segment, mask, start, end in zip(self.segments, self.masks, self.cu, self.cu[1:]):
            keys = append_kv(segment.cache.k[layer], k[start:end], segment.past)  # [past + n, Hkv, D]
            values = append_kv(segment.cache.v[layer], v[start:end], segment.past)
            out[start:end] = attend(q[start:end], keys, values, mask)  # never a [T, T] matrix
        return out
        # END SOLUTION


@dataclass
class RaggedSequence:
    """A request in flight: its tokens so far (prompt, then outputs) and its own KV cache."""

    request: int  # index in the caller's list of prompts
    tokens: list[int]
    prompt_len: int
    max_new: int
    cache: KVCache

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: the prompt at first, then the token sampled last."""
        return len(self.tokens) - self.cache.length

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.prompt_len == self.max_new


def new_sequence(model: Decoder, request: int, prompt: list[int], max_new: int) -> RaggedSequence:
    return RaggedSequence(request, list(prompt), len(prompt), max_new, KVCache(model, len(prompt) + max_new))


@dataclass
class Step:
    """What one forward pass did, for timelines and time-to-first-token: which tokens of which
    request it ran, as (request, past, num_new), and the tokens it produced, as (request, token)."""

    plan: list[tuple[int, int, int]] = field(default_factory=list)
    produced: list[tuple[int, int]] = field(default_factory=list)


def run_step(
    model: Decoder, seqs: list[RaggedSequence], num_new: list[int], attention_type: type[RaggedAttention] = RaggedAttention
) -> torch.Tensor:
    """Feed the next num_new[i] pending tokens of each seqs[i], all in one flat run, and
    return the final hidden state of each segment's last token: [len(seqs), hidden]."""
    segments = [Segment(s.cache, s.cache.length, n) for s, n in zip(seqs, num_new)]
    ids = [t for s, seg in zip(seqs, segments) for t in s.tokens[seg.past:seg.past + seg.num_new]]
    positions = torch.cat([torch.arange(seg.past, seg.past + seg.num_new, device=model.device) for seg in segments])
    attention = attention_type(segments)
    hidden = model(as_tensor(ids, model.device), positions, attention)
    for s, seg in zip(seqs, segments):
        if s.cache.length != seg.past:  # every layer must have seen the same past
            raise RuntimeError(f"the attention moved cache.length from {seg.past} to {s.cache.length}: leave it "
                               "alone, the stage moves it on once every layer has run")
        s.cache.length += seg.num_new
    return hidden[as_tensor(attention.cu[1:], model.device) - 1]


def record_step(live: list[RaggedSequence], num_tokens: int, stats: StageStats | None) -> None:
    """No padding, no finished rows: every slot is useful. KV: only the live sequences' caches."""
    if stats:
        stats.token_slots += num_tokens
        stats.record_kv(used=sum(s.cache.length for s in live), reserved=sum(s.cache.k.shape[1] for s in live))


@torch.inference_mode()
def steps(
    model: Decoder, prompts: list[list[int]], lengths: list[int], batch_size: int = 8, stats: StageStats | None = None
) -> Iterator[Step]:
    """Run the requests `batch_size` at a time, one `Step` per forward pass. `lengths`: each
    request's number of output tokens (generate checks them with `prepare` first)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    todo = [i for i, n in enumerate(lengths) if n > 0]  # a request for 0 tokens needs no forward pass
    for first in range(0, len(todo), batch_size):
        live = [new_sequence(model, i, prompts[i], lengths[i]) for i in todo[first:first + batch_size]]
        while live:
            num_new = [s.num_pending for s in live]  # a whole prompt, or one token
            step = Step(plan=[(s.request, s.cache.length, n) for s, n in zip(live, num_new)])
            next_tokens = model.lm_head(run_step(model, live, num_new)).argmax(-1).tolist()
            for s, token in zip(live, next_tokens):
                s.tokens.append(token)
                step.produced.append((s.request, token))
            record_step(live, sum(num_new), stats)
            live = [s for s in live if not s.done]  # a finished sequence leaves (and frees its cache) now
            yield step


def generate(
    model: Decoder, prompts: list[list[int]], max_new_tokens: int | list[int], stats: StageStats | None = None,
    batch_size: int = 8,
) -> list[list[int]]:
    lengths = prepare(model, prompts, max_new_tokens)
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in steps(model, prompts, lengths, batch_size, stats):
        for request, token in step.produced:
            outputs[request].append(token)
    return outputs
