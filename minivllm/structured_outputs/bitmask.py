"""The mask in the sampler (chapter 13): every step, the rows under a grammar lose every token
the grammar forbids, before anything else looks at their logits.

xgrammar says which tokens may come next as a **bitmask**: ceil(V / 32) int32 words per row,
bit j of word w standing for token 32 * w + j (1 = allowed). For the embedded model's 4,096
tokens that is 128 words, 512 bytes a row, filled by the matcher in C++ from tables it computed
when the grammar was compiled. The sampler then sets the forbidden logits to -inf, so that
greedy decoding takes the argmax over the allowed tokens, sampling draws only among them, and
the logprobs a request reports are those of the masked distribution (as vLLM reports them).
Rows without a grammar are not touched, and a step without one costs nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # type hints only: the sequence module imports this package, not the reverse
    from minivllm.structured_outputs.matcher import SequenceGrammar

BITS = 32  # tokens per bitmask word


def num_words(vocab_size: int) -> int:
    """int32 words per bitmask row: ceil(vocab_size / 32)."""
    return -(-vocab_size // BITS)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Forbid, in place, every token the bitmask does not allow: logits[rows[r], t] becomes -inf
    where bit t % 32 of word t // 32 of bitmask[r] is 0 (least significant bit first).

    logits: [S, V] float (modified in place; rows not listed in rows stay untouched).
    bitmask: [R, W] torch.int32 on any device, W = ceil(V / 32) words per row (a set bit allows
    its token; the sign bit is bit 31, so a word of -1 allows 32 tokens; bits past V are ignored).
    rows: R distinct indices into logits' rows: bitmask[r] is row rows[r]'s mask.
    Returns None. Raises ValueError if bitmask is not int32, or its shape is not [len(rows), W].
    """
    if bitmask.dtype != torch.int32 or bitmask.shape != (len(rows), num_words(logits.shape[-1])):
        raise ValueError(f"bitmask must be torch.int32 of shape [{len(rows)}, {num_words(logits.shape[-1])}] "
                         f"for {len(rows)} rows of {logits.shape[-1]} logits, got {bitmask.dtype} "
                         f"{list(bitmask.shape)}")
    # BEGIN SOLUTION
    shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]  # [R, W * 32] -> [R, V]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    # END SOLUTION


@torch.inference_mode()  # the logits come from the model runner's inference mode: only there may they change in place
def constrain_logits(logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
    """The sampler's first step: fill one bitmask for the rows that have a grammar (row s of
    logits belongs to the sequence whose grammar is grammars[s], None for no constraint) and
    apply it to their logits, in place."""
    rows = [s for s, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return
    bitmask = torch.empty(len(rows), num_words(logits.shape[-1]), dtype=torch.int32)  # every word is filled
    for r, s in enumerate(rows):
        grammars[s].matcher.fill_next_token_bitmask(bitmask, r)
    apply_token_bitmask(logits, bitmask, rows)
