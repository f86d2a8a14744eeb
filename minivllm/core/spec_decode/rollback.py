"""Undo what a verify step computed for guesses the target rejected (chapter 12).

A verify step ran a sequence's last token and its D guesses as one chunk, so when it ends the
sequence counts all 1 + D positions as computed and its block table holds their keys and
values. Only the accepted guesses may stay: the K/V of a rejected guess describe a token the
sequence will never have. Paging makes the rollback cheap: move the computed-token counter back
and hand the blocks that held nothing but rejected guesses back to the pool. (Their slots in a
block that is kept are simply overwritten by the next step: attention never reads past a
sequence's computed tokens.)
"""
from __future__ import annotations

from minivllm.core.block_manager import BlockManager
from minivllm.request.sequence import Sequence


def rollback(seq: Sequence, num_rejected: int, block_manager: BlockManager) -> None:
    """Take back seq's guesses after its verify step.

    Before: the last seq.num_spec_tokens entries of seq.token_ids are the step's guesses, and
    seq.num_computed_tokens counts every position of the chunk (the last real token and every
    guess). The target accepted the first num_spec_tokens - num_rejected guesses.
    After: the guesses are gone from seq.token_ids (the engine appends the accepted ones again,
    then the token the target drew, through Sequence.append_token, which checks stop conditions
    token by token); seq.num_spec_tokens is 0; seq.num_computed_tokens has dropped by
    num_rejected (the accepted guesses' K/V stay: they are what decoding them one at a time
    would have written); and seq.block_table holds exactly block_manager.blocks_for(
    seq.num_computed_tokens) blocks, the others given back with block_manager.shrink.
    Raises ValueError (changing nothing) unless 0 <= num_rejected <= seq.num_spec_tokens.
    Invariant: every block is still free or owned, as the block manager's checks require."""
    if isinstance(num_rejected, bool) or not isinstance(num_rejected, int) or not 0 <= num_rejected <= seq.num_spec_tokens:
        raise ValueError(f"num_rejected must be an integer in [0, {seq.num_spec_tokens}] (the guesses), got {num_rejected!r}")
    # BEGIN SOLUTION
    del seq.token_ids[len(seq.token_ids) - seq.num_spec_tokens:]
    seq.num_spec_tokens = 0
    seq.num_computed_tokens -= num_rejected
    block_manager.shrink(seq.block_table, seq.num_computed_tokens)
    # END SOLUTION
