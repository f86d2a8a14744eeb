"""Hands out and takes back the fixed-size blocks of the paged KV cache (chapter 6).

The manager only counts blocks; each sequence keeps its own block table (a list of physical
block ids, in logical order). Invariants the tests check: a block is either free or owned by
exactly one table, and every block comes back when its sequence is freed.
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))
        # Prompt tokens looked up in / found in the prefix cache (chapter 11): none here.
        self.queried_tokens = self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens (a partly filled last block counts)."""
        return -(-num_tokens // self.block_size)

    def missing_blocks(self, table: list[int], num_tokens: int) -> int:
        """How many more blocks `table` needs to hold num_tokens tokens."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        # missing_blocks(table, num_tokens) <= num_free, written out: the scheduler asks this of
        # every running request every step, and each Python call costs as much as the sum.
        return -(-num_tokens // self.block_size) - len(table) <= len(self.free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append free blocks to `table`, taken from the front of self.free, until it can hold
        num_tokens tokens: len(table) == blocks_for(num_tokens) afterwards, or unchanged if it
        was already that long (tables never shrink). If too few blocks are free, raise
        RuntimeError("out of KV blocks: ...") and change nothing, neither `table` nor self.free."""
        # BEGIN SOLUTION
        needed = self.missing_blocks(table, num_tokens)
        if needed > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free} free")
        table.extend(self.free.popleft() for _ in range(needed))
        # END SOLUTION

    def reuse_prefix(self, seq) -> int:
        """Chapter 11's prefix caching puts blocks that already hold seq's first tokens into its
        table here and returns how many tokens they hold. This manager shares nothing: 0."""
        return 0

    def release(self, table: list[int]) -> None:
        """Give every block of `table` back and empty it."""
        self.free.extend(table)
        table.clear()

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks of `table` beyond the first blocks_for(num_tokens), last first
        (chapter 12's rollback: the blocks that held only rejected guesses)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._give_back(table.pop())

    def _give_back(self, block: int) -> None:
        self.free.append(block)
