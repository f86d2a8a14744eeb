"""Prefix caching: KV blocks shared between requests that start with the same tokens (chapter 11).

Paging made a KV block an object with an owner. Here a block may have several: requests that
begin with the same tokens (a shared system prompt, few-shot examples, the earlier turns of a
chat, the n samples of one prompt) reuse the blocks that already hold those tokens' keys and
values instead of computing them again.

How a block is recognised. The K and V of a token depend on the token *and on every token
before it*, so a block's content is named by a hash of its own tokens chained with the hash of
the block before it:

    hash_0 = H(None, tokens[0:B]),  hash_i = H(hash_{i-1}, tokens[i*B:(i+1)*B])

Two requests have the same block i exactly when their first (i+1)*B tokens agree. Only *full*
blocks get a hash: a block still being filled is never shared, so a request never writes into
a block another one reads (we recompute the partial tail instead of copy-on-write).

The manager keeps, beside chapter 6's free list:
- `ref_counts[b]`: how many live block tables hold block b;
- `cached`: hash -> the block holding that content, for every full block whose K/V are (or
  are being, this very step) written;
- the free list in least-recently-used order. A block whose last owner lets go keeps its
  content and stays findable in `cached` until the pool needs its memory: then the least
  recently freed block is taken and its hash forgotten (evicted). Nothing owned is evicted.

When the scheduler admits a request it first takes the longest cached prefix of the request's
tokens (`reuse_prefix`), and starts computing after it; at least the last token is always
computed, so that it has logits to sample from. A block is registered in `cached` as soon as
the tokens granted to it fill it, which is also when its K/V are written: a request admitted
later in the same step can share it, because every layer stores the step's K/V before any
token attends (the n samples of one prompt share their prompt this way).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterator
from collections.abc import Sequence as Seq

import numpy as np

from minivllm.core.block_manager import BlockManager
from minivllm.request.sequence import Sequence


def hash_block(parent: bytes | None, tokens: Seq[int]) -> bytes:
    """The name of a full block's content: SHA-256 of the parent block's hash (b"" for the
    first block) followed by the block's token ids as little-endian int64."""
    digest = hashlib.sha256(parent or b"")
    digest.update(np.asarray(tokens, dtype="<i8").tobytes())
    return digest.digest()


def block_hashes(token_ids: Seq[int], block_size: int) -> list[bytes]:
    """The chained hashes of the *full* blocks of token_ids, in order.

    token_ids: a sequence's tokens; block_size >= 1. Returns len(token_ids) // block_size
    hashes: hashes[i] = hash_block(hashes[i-1] or None for i = 0, token_ids[i*B:(i+1)*B]). A
    partly filled last block has no hash. Invariant: two token lists share their first k hashes
    exactly when they share their first k*B tokens."""
    # BEGIN SOLUTION
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes
    # END SOLUTION


class FreeBlocks:
    """Free blocks in least-recently-freed order: popleft() takes the oldest (the next to be
    evicted), append() puts a block at the young end, remove() takes a given block out (a
    cache hit on a free block) in O(1)."""

    def __init__(self, blocks: Seq[int]):
        self._order: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)

    def popleft(self) -> int:
        return self._order.popitem(last=False)[0]

    def append(self, block: int) -> None:
        self._order[block] = None

    def remove(self, block: int) -> None:
        del self._order[block]

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __contains__(self, block: object) -> bool:
        return block in self._order


class PrefixCachingBlockManager(BlockManager):
    """Chapter 6's block manager with reference counts and a cache of full blocks by content."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.free = FreeBlocks(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # content hash -> block
        self.block_hash: dict[int, bytes] = {}  # block -> its content hash, for blocks in `cached`
        # The sequence behind each live table (by id of its list) and its full blocks' hashes,
        # so that grow() can register the blocks that the granted tokens fill.
        self.owners: dict[int, tuple[Sequence, list[bytes]]] = {}
        self.pending_hits: dict[int, int] = {}  # tables looked up by reuse_prefix, not yet admitted: tokens found

    @property
    def num_cached_free(self) -> int:
        """Free blocks whose content is still findable (evicted only when memory is needed)."""
        return sum(b in self.block_hash for b in self.free)

    def longest_cached_prefix(self, hashes: Seq[bytes]) -> list[int]:
        """The blocks holding the longest run of leading hashes found in the cache.

        hashes: a request's chained full-block hashes, in order. Returns [cached[h0], cached[h1],
        ...] up to (not including) the first hash not in self.cached; [] if the first is missing.
        Reads only: no reference count or list changes. Invariant: a prefix, never a gap (block
        i+1's K/V were computed assuming block i's tokens before it)."""
        # BEGIN SOLUTION
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks
        # END SOLUTION

    def reuse_prefix(self, seq: Sequence) -> int:
        """Put the cached blocks of seq's longest known prefix into its (empty) table and return
        how many tokens they hold; seq computes from there. At least its last token is left to
        compute, so that the step has a row to sample from. A request that asked for prompt
        logprobs reuses nothing: it needs the logits of every prompt token."""
        hashes = block_hashes(seq.token_ids, self.block_size)
        usable = (seq.num_tokens - 1) // self.block_size  # full blocks before the last token
        if seq.params.prompt_logprobs is not None:
            usable = 0
        blocks = self.longest_cached_prefix(hashes[:usable])
        for block in blocks:
            if self.ref_counts[block] == 0:
                self.free.remove(block)  # a hit on a free block: it is owned again, not evicted
            self.ref_counts[block] += 1
        seq.block_table.extend(blocks)
        self.owners[id(seq.block_table)] = (seq, hashes[:len(blocks)])
        # Counted when the request is admitted (its first grow), not here: the head of the queue
        # may look its prefix up, not fit, give the blocks back and look again every step.
        self.pending_hits[id(seq.block_table)] = len(blocks) * self.block_size
        return len(blocks) * self.block_size

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Chapter 6's grow, taking the least recently freed blocks (evicting their content),
        then registering every block that num_tokens tokens fill. The first grow after
        reuse_prefix admits the request: its lookup and hits are counted then."""
        # missing_blocks, written out (every running request grows every step, mostly by nothing)
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {needed}, {self.num_free} free")
        hits = self.pending_hits.pop(id(table), None)
        if hits is not None:
            seq = self.owners[id(table)][0]
            self.queried_tokens += seq.num_tokens
            self.hit_tokens += hits
            if seq.num_preemptions == 0:  # its first admission: what the request itself reports
                seq.num_cached_tokens = hits
        for _ in range(needed):
            block = self.free.popleft()
            self._evict(block)
            self.ref_counts[block] = 1
            table.append(block)
        owner = self.owners.get(id(table))
        if owner is not None and len(owner[1]) < num_tokens // self.block_size:  # a block newly filled
            self._register_full_blocks(table, num_tokens)

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Chapter 6's shrink; the table's chain of hashes is cut to its remaining blocks, so the
        next block it fills is named after its new parent, not after the block it replaced."""
        super().shrink(table, num_tokens)
        owner = self.owners.get(id(table))
        if owner is not None:
            del owner[1][len(table):]

    def _give_back(self, block: int) -> None:
        """shrink()'s one block: its owner lets go (chapter 12's rollback never reaches a named
        block: named blocks hold only verified tokens, and those are kept)."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free.append(block)

    def _evict(self, block: int) -> None:
        """Forget what a free block held: its memory is about to be written."""
        assert self.ref_counts[block] == 0, f"block {block} is owned and cannot be evicted"
        content = self.block_hash.pop(block, None)
        if content is not None:
            del self.cached[content]

    def _register_full_blocks(self, table: list[int], num_tokens: int) -> None:
        """Name each block that the first num_tokens tokens fill (their K/V are written this step).
        A block that holds a guess not yet verified (chapter 12), or a placeholder (chapter 16), is not named: its K/V may be
        rolled back, so it waits until the tokens in it are the sequence's own."""
        seq, hashes = self.owners[id(table)]
        known = seq.num_tokens - seq.num_spec_tokens - seq.num_output_placeholders  # chapter 16: nor a placeholder
        for i in range(len(hashes), min(num_tokens, known) // self.block_size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size]))
            # Another block may already hold the same content (two requests computed it side by
            # side before either was cached): keep that one; this block stays unnamed.
            if hashes[-1] not in self.cached:
                self.cached[hashes[-1]] = table[i]
                self.block_hash[table[i]] = hashes[-1]

    def release(self, table: list[int]) -> None:
        """Let go of every block of `table` and empty it.

        Each block's reference count drops by one; a block nobody holds any more goes to the
        young end of self.free, keeping its content (it stays in self.cached until evicted).
        Blocks are let go last block first, so a request's tail is evicted before its prefix,
        which other requests are likelier to share. Invariant afterwards: every block's count
        equals the number of live tables holding it, free + owned blocks = the pool, and
        `table` is empty."""
        self.owners.pop(id(table), None)  # the table's bookkeeping for grow (not the exercise)
        self.pending_hits.pop(id(table), None)  # looked up, never admitted: nothing to count
        # BEGIN SOLUTION
        for block in reversed(table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free.append(block)
        table.clear()
        # END SOLUTION
