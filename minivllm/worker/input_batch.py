"""The persistent batch: a running request keeps its row from step to step (chapter 16).

Why. Chapter 9 builds every step's inputs from the requests' Python lists: at batch 256 with
contexts of ~650 tokens that is 256 block tables of ~40 blocks each, converted list by list
into a fresh array, every step, although a decode step changes almost nothing: each request
moves one position on, and one in sixteen starts a new block. Measured on an H200 the host
spent 0.88 ms preparing a step the GPU runs in 6 ms, and the GPU waited for it.

Here the block tables live in one preallocated array, one row per running request (vLLM's
`InputBatch`). A step writes only its *differences*:
1. a request seen for the first time gets a free row and writes its whole table;
2. a request that kept its row writes only the blocks it gained since its last step;
3. a row whose request is gone (finished, aborted, preempted) is cleared and reused.
A step's tables are then one gather of its rows, `tables[rows, :W]`, with no Python per block.

The price: the batch must notice every way a table can change other than by growing at its
end. A preemption empties the table and refills it (the row remembers the request's
`num_preemptions`). Chapter 12's rollback can shrink a table and grow it again, between two
steps, with other blocks anywhere past the cut: under speculation (`rollback=True`) each row is
compared whole with its table, a C-speed list comparison, but one per block again. Everything else about a step (ids,
positions, slots, sampling rows) is computed exactly as chapter 9 computes it, so the arrays
are equal to `build_step_arrays`' (tests/test_ch16_persistent_batch.py checks that, step by
step, under preemption and rollback).

On a GPU an eager step's packed inputs go to the device from one of two preallocated pinned
buffers, not a freshly pinned one each step; two, because under async scheduling
(async_scheduling.py) the host prepares step N+1 while step N's copy may still be queued behind
the GPU's work. (A graph replay's copy is still chapter 9's, `GraphRunner.load`.)
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from minivllm.request.sequence import Sequence, Status
from minivllm.worker.prepare import StepArrays, build_step_arrays, to_device


class InputBatch:
    """Rows of block tables that persist across steps, and the pinned buffers a step's inputs
    leave from. width: the most blocks a table can hold (grows if a table needs more)."""

    def __init__(self, max_num_seqs: int, width: int, block_size: int, device: torch.device, rollback: bool = False):
        self.block_size, self.device = block_size, torch.device(device)
        self.rollback = rollback  # tables may shrink and regrow between steps: compare rows whole
        self.row_of: dict[Sequence, int] = {}
        self.tables = np.full((max_num_seqs, width), -1, dtype=np.int64)  # -1 past each row's end, always
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # blocks written into each row
        self.version = np.zeros(max_num_seqs, dtype=np.int64)  # the request's num_preemptions when written
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.staging: list[torch.Tensor] = []  # pinned host buffers (CUDA only), used in turn
        self.copied: list[torch.cuda.Event | None] = []
        self.turn = 0

    def __len__(self) -> int:
        return len(self.row_of)

    def update(self, seqs: Seq[Sequence]) -> np.ndarray:
        """Apply a step's differences: bring the rows of `seqs` up to date with their block tables
        and return their rows, int64 [len(seqs)], in the order of seqs.

        A sequence without a row (not in self.row_of) gets one from self._new_row(seq, seqs),
        with nothing written yet. A sequence with a row has self.num_blocks[row] blocks of its
        table written there. That row is stale, and is cleared (its written blocks set back to -1)
        and written whole, when the sequence was preempted since (self.version[row] differs from
        seq.num_preemptions; set it to the new count), when its table is now shorter than what
        was written, or, only if self.rollback, when the written blocks differ from the first
        blocks of its table. Otherwise only the blocks it gained, seq.block_table[known:], are
        written: a decode step usually writes nothing, or one block. Afterwards, for every
        sequence, self.tables[row, :len(table)] equals its block table, self.num_blocks[row] its
        length, and the row holds -1 past its end. A table longer than self.tables is wide calls
        self._widen(len(table)) first. Nothing else changes, and other rows are untouched."""
        # BEGIN SOLUTION
        # Which rows differ, found for the whole step at once: three reads per sequence, each a
        # list comprehension, compared with the rows' records in one NumPy expression. Only the
        # rows that differ (a newcomer, a new block, a preemption) are visited one by one.
        rows = [self.row_of.get(seq) for seq in seqs]
        if None in rows:
            rows = [self._new_row(seq, seqs) if row is None else row for seq, row in zip(seqs, rows)]
        rows = np.array(rows, dtype=np.int64).reshape(len(seqs))
        lengths = np.array([len(seq.block_table) for seq in seqs], dtype=np.int64).reshape(len(seqs))
        versions = np.array([seq.num_preemptions for seq in seqs], dtype=np.int64).reshape(len(seqs))
        differ = (self.num_blocks[rows] != lengths) | (self.version[rows] != versions)
        for i in range(len(seqs)) if self.rollback else np.flatnonzero(differ).tolist():
            seq, row = seqs[i], int(rows[i])
            table, known, now = seq.block_table, int(self.num_blocks[row]), len(seq.block_table)
            if (self.version[row] != seq.num_preemptions or known > now
                    or (self.rollback and self.tables[row, :known].tolist() != table[:known])):
                self.tables[row, :known] = -1  # refilled after a preemption, or rolled back and regrown
                known, self.version[row] = 0, seq.num_preemptions
            if now > known:
                if now > self.tables.shape[1]:
                    self._widen(now)
                self.tables[row, known:now] = table[known:now]  # the difference: usually nothing, or one block
            self.num_blocks[row] = now
        return rows
        # END SOLUTION

    def _new_row(self, seq: Sequence, step: Seq[Sequence]) -> int:
        """A row for a newcomer (registered in self.row_of, nothing written): a free one, else the
        row of a request that stopped running (found lazily, only when the free rows run out),
        else a larger array."""
        if not self.free_rows:
            scheduled = set(step)
            # A request that stopped running, or a table let go of (a forgotten draft shadow, chapter 12).
            for gone in [s for s in self.row_of if (s.status is not Status.RUNNING or not s.block_table)
                         and s not in scheduled]:
                self.release(gone)
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.row_of[seq] = row
        self.version[row] = seq.num_preemptions
        return row

    def release(self, seq: Sequence) -> None:
        """Give seq's row back, cleared (a later request may get it)."""
        row = self.row_of.pop(seq)
        self.tables[row, :self.num_blocks[row]] = -1
        self.num_blocks[row] = 0
        self.free_rows.append(row)

    def _grow_rows(self) -> None:
        old = len(self.tables)
        self.tables = np.concatenate([self.tables, np.full_like(self.tables, -1)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(old, np.int64)])
        self.version = np.concatenate([self.version, np.zeros(old, np.int64)])
        self.free_rows = list(range(2 * old - 1, old - 1, -1)) + self.free_rows

    def _widen(self, width: int) -> None:
        wider = np.full((len(self.tables), max(width, 2 * self.tables.shape[1])), -1, dtype=np.int64)
        wider[:, :self.tables.shape[1]] = self.tables
        self.tables = wider

    def step_arrays(
        self, seqs: Seq[Sequence], num_new_tokens: Seq[int], num_rows: int | None = None, pad_block: int | None = None,
        query_len: int | None = None,
    ) -> StepArrays:
        """What build_step_arrays(seqs, num_new_tokens, block_size, num_rows, pad_block=pad_block,
        query_len=query_len) returns, with the block tables gathered from the persistent rows."""
        S = len(seqs)
        rows = self.update(seqs)
        num_rows = S if num_rows is None else num_rows
        width = int(self.num_blocks[rows].max(initial=0))
        if num_rows > S:
            width = max(width, 1)  # a padding row's table: [pad_block]
        tables = np.full((max(num_rows, S), width), -1, dtype=np.int64)
        tables[:S] = self.tables[rows, :width]
        if num_rows > S and pad_block is not None:
            tables[S:, 0] = pad_block
        return build_step_arrays(seqs, num_new_tokens, self.block_size, num_rows, pad_block=pad_block,
                                 query_len=query_len, block_tables=tables)

    def to_device(self, packed: np.ndarray) -> torch.Tensor:
        """prepare.to_device, from a preallocated pinned buffer on CUDA (two, used in turn, each
        reused only once the copy that last read it is done)."""
        if self.device.type != "cuda":
            return to_device(packed, self.device)
        turn, self.turn = self.turn, 1 - self.turn
        if len(self.staging) < 2 or len(self.staging[turn]) < len(packed):
            self.staging = [torch.empty(2 * len(packed), dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self.copied = [None, None]
        elif self.copied[turn] is not None:
            self.copied[turn].synchronize()  # the copy two steps ago: long done unless the GPU is far behind
        host = self.staging[turn][:len(packed)]
        host.numpy()[:] = packed
        flat = host.to(self.device, non_blocking=True)
        self.copied[turn] = torch.cuda.Event()
        self.copied[turn].record()
        return flat
