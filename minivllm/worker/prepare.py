"""A step's inputs without per-token Python, in one copy to the device (chapter 9).

Chapter 7's runner built each input as a Python list, token by token: the ids, the positions,
and a slot for every token through `slot_mapping`; then `torch.tensor(list, device=cuda)` for
each of them. On a GPU that costs twice. The Python loops grow with the tokens of the step,
and every `torch.tensor(..., device="cuda")` from ordinary host memory is a synchronous copy:
the host waits until the GPU has finished everything queued before it, so the host can never
run ahead and prepare the next step while the GPU computes this one.

Here every field is one vectorised NumPy expression over the whole step (Python loops only
over *sequences*, to read their token lists and block tables), all fields are packed into one
int64 buffer, and that buffer reaches the device in one copy from pinned (page-locked) memory
with `non_blocking=True`, which the GPU's copy engine performs without stopping the host.

The packed layout, for T tokens from S sequences and block tables W wide:

    [ input_ids T | positions T | slot_mapping T | query_start S+1 | context_lens S | block_tables S*W | sample_rows R ]

`StepArrays.unpack` cuts a device tensor in that layout into the same fields. The CUDA-graph
runner (cuda_graphs.py) copies the packed buffer of a decode step into a fixed device buffer.
Its captured graphs read the fields before the tables there, at offsets that are the same for
every decode step of a batch-size bucket (T = S = the bucket), and read the block tables from a
buffer of their own, as wide as the longest context the engine allows: the runner writes the
step's tables into its first columns, on the device.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.attention.paged import PagedBatch
from minivllm.request.sequence import Sequence


@dataclass
class StepArrays:
    """One step's inputs on the host (int64 NumPy arrays), as PagedBatch and the model read them."""

    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] flat pool slot where each token's K and V go
    query_start: np.ndarray  # [S + 1] cumulative tokens per sequence (cu_seqlens)
    context_lens: np.ndarray  # [S] cached tokens after this step
    block_tables: np.ndarray  # [S, W] physical blocks, -1 past each table's end
    sample_rows: np.ndarray  # [R] rows whose logits are needed: the last row of each sequence that
    # predicts a token, or its last 1 + D rows when its chunk ends in D guesses (chapter 12)
    samplers: list[int]  # which sequences those are (indices into the step's list), in row order

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def pack(self, tables: bool = True) -> np.ndarray:
        """Every field end to end in one int64 buffer (see the module doc); without the block
        tables if not `tables`."""
        block_tables = self.block_tables.ravel() if tables else self.block_tables[:, :0].ravel()
        return np.concatenate([self.input_ids, self.positions, self.slot_mapping, self.query_start,
                               self.context_lens, block_tables, self.sample_rows])

    def unpack(self, flat: torch.Tensor, tables: bool = True) -> dict[str, torch.Tensor]:
        """Views of a buffer in this step's packed layout, pack(tables) (on any device), field by field."""
        S, W = self.block_tables.shape
        return unpack(flat, self.num_tokens, S, W if tables else 0, len(self.sample_rows))


def unpack(flat: torch.Tensor, num_tokens: int, num_seqs: int, width: int, num_samples: int) -> dict[str, torch.Tensor]:
    """Views of a packed buffer of T tokens, S sequences, tables W wide and R sampling rows."""
    T, S = num_tokens, num_seqs
    sizes = dict(input_ids=T, positions=T, slot_mapping=T, query_start=S + 1, context_lens=S, block_tables=S * width,
                 sample_rows=num_samples)
    used = sum(sizes.values())
    views = dict(zip(sizes, flat[:used].split(list(sizes.values()))))
    views["block_tables"] = views["block_tables"].view(S, width)
    return views


def build_step_arrays(
    seqs: Seq[Sequence], num_new_tokens: Seq[int], block_size: int, num_rows: int | None = None,
    width: int | None = None, pad_block: int | None = None, query_len: int | None = None,
    block_tables: np.ndarray | None = None,
) -> StepArrays:
    """The inputs of a step where seqs[i] computes its next num_new_tokens[i] tokens.

    For a CUDA graph, `num_rows` pads the step with dummy one-token sequences up to a captured
    batch size, and `width` widens the block tables to the captured width. A padding row reads
    and writes only block `pad_block`, a block no request ever owns, so it disturbs nothing.

    `query_len` (chapter 12's verify graphs) gives every sequence exactly that many rows: its
    real tokens first, then padding tokens (id 0, at its last real position) that write only
    the first slot of `pad_block` and are never sampled. Its context then counts all query_len
    rows, so row j of every sequence sees the keys up to context - query_len + j: the real rows
    see exactly their own past, and table columns past a sequence's own blocks read `pad_block`.

    `block_tables` [num_rows, W]: the step's tables already laid out, each row's blocks first and
    -1 after them (chapter 16's persistent batch gathers them from its rows), instead of copying
    each sequence's list here.
    """
    S = len(seqs)
    # The only loops over sequences: reading each one's counters and tokens, one list
    # comprehension each (a list comprehension reads an attribute in ~20 ns; NumPy on 256 rows
    # costs about as much as one Python call, so everything after these reads is vectorised).
    past = [s.num_computed_tokens for s in seqs]
    # A decode step (one token each, no fixed query length): token t is sequence t's only row.
    decode = query_len is None and list(num_new_tokens).count(1) == S
    query_lens = np.ones(S, np.int64) if decode else np.array(num_new_tokens, dtype=np.int64).reshape(S)
    past_lens = np.array(past, dtype=np.int64).reshape(S)
    num_tokens = np.array([len(s.token_ids) for s in seqs], dtype=np.int64).reshape(S)
    rows = S if num_rows is None else num_rows
    if rows < S:
        raise ValueError(f"a step of {S} sequences does not fit {rows} rows")
    if (rows > S or query_len is not None) and pad_block is None:
        raise ValueError("padding rows need a pad_block to read and write")
    if query_len is not None and (query_lens > query_len).any():
        raise ValueError(f"a step with chunks of {query_lens.max()} tokens does not fit {query_len} rows each")
    if decode:
        new_ids = [s.token_ids[p] for s, p in zip(seqs, past)]
    else:
        new_ids = list(itertools.chain.from_iterable(s.token_ids[p:p + n] for s, p, n in zip(seqs, past, num_new_tokens)))
    if rows > S:
        query_lens = np.concatenate([query_lens, np.ones(rows - S, np.int64)])
        past_lens = np.concatenate([past_lens, np.zeros(rows - S, np.int64)])
    row_lens = query_lens if query_len is None else np.full(rows, query_len, np.int64)  # real + padding tokens
    context_lens = past_lens + row_lens
    if block_tables is None:
        tables = [s.block_table for s in seqs] + [[pad_block]] * (rows - S)
        table_lens = np.array([len(t) for t in tables], dtype=np.int64).reshape(rows)
    elif query_len is not None or width is not None:  # (laid-out tables are as wide as their longest)
        table_lens = (block_tables >= 0).sum(axis=1)
    if query_len is not None:
        needed = -(-context_lens // block_size)  # columns attention reads
        longest = max(int(table_lens.max()), int(needed.max()))
    else:
        longest = int(table_lens.max(initial=0)) if block_tables is None or width is not None else block_tables.shape[1]
    W = max(longest, 0 if block_tables is None else block_tables.shape[1]) if width is None else width
    if W < longest:
        raise ValueError(f"tables of {longest} blocks do not fit {W} columns")
    if block_tables is None:
        block_tables = np.full((rows, W), -1, dtype=np.int64)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = table
    elif block_tables.shape[1] < W:
        block_tables = np.pad(block_tables, ((0, 0), (0, W - block_tables.shape[1])), constant_values=-1)
    if query_len is not None:
        columns = np.arange(W)[None, :]
        block_tables[(columns >= table_lens[:, None]) & (columns < needed[:, None])] = pad_block

    if decode:  # the same as below, with every row one token: no repeat, no cumulative sums
        query_start = np.arange(rows + 1, dtype=np.int64)
        seq_of = query_start[:-1]
        positions = past_lens
    else:
        query_start = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(row_lens, out=query_start[1:])
        # Token t is row j of sequence seq_of[t]; a real one sits at position past + j.
        seq_of = np.repeat(np.arange(rows), row_lens)
        j = np.arange(len(seq_of), dtype=np.int64) - query_start[:-1][seq_of]
        real = (j < query_lens[seq_of]) & (seq_of < S)
        positions = past_lens[seq_of] + np.minimum(j, query_lens[seq_of] - 1)
    input_ids = np.zeros(len(seq_of), dtype=np.int64)  # padding feeds token 0
    input_ids[slice(S) if decode else np.flatnonzero(real)] = new_ids

    # Token at position p lives in block table[p // block_size], at offset p % block_size.
    slot_mapping = block_tables[seq_of, positions // block_size] * block_size + positions % block_size
    if query_len is not None:
        slot_mapping[~real] = pad_block * block_size

    samplers = np.flatnonzero(past_lens[:S] + query_lens[:S] == num_tokens)  # caught up: the last row predicts a token
    last_rows = query_start[samplers] + query_lens[samplers] - 1
    # A chunk that ends in D guesses (chapter 12) needs its last 1 + D real rows: each row scores
    # the next position, the guess after it or, after the last guess, the bonus token.
    guesses = [seqs[i].num_spec_tokens for i in samplers.tolist()]
    if any(guesses):
        rows_each = 1 + np.array(guesses, dtype=np.int64)
        first = np.repeat(last_rows + 1 - rows_each, rows_each)
        offset = np.arange(int(rows_each.sum())) - np.repeat(np.cumsum(rows_each) - rows_each, rows_each)
        sample_rows = first + offset
    else:
        sample_rows = last_rows
    return StepArrays(input_ids, positions, slot_mapping, query_start, context_lens, block_tables, sample_rows,
                      samplers.tolist())


def to_device(array: np.ndarray, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """One host->device copy of `array` (into `out`, if given) that never makes the host wait:
    from pinned memory, non-blocking. On the CPU it is a plain copy (or no copy at all)."""
    host = torch.from_numpy(array)
    if device.type == "cuda":
        host = host.pin_memory()
    if out is not None:
        return out.copy_(host, non_blocking=True)
    return host.to(device, non_blocking=True)


@dataclass
class DeviceStep:
    """A step's inputs on the device: what the model and paged attention read."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    batch: PagedBatch
    sample_rows: torch.Tensor  # [R]


def device_step(
    arrays: StepArrays, flat: torch.Tensor, max_context_len: int | None = None, block_tables: torch.Tensor | None = None,
) -> DeviceStep:
    """The step's fields as views of `flat`, a device buffer holding arrays.pack(), or, with
    `block_tables` (a device tensor of the step's tables, kept apart), arrays.pack(tables=False).
    The host keeps the per-sequence lengths (attention sizes its work from them without asking
    the GPU)."""
    views = arrays.unpack(flat, tables=block_tables is None)
    batch = PagedBatch(
        query_lens=np.diff(arrays.query_start).tolist(), query_start=arrays.query_start.tolist(),
        context_lens=arrays.context_lens.tolist(),
        block_tables=views["block_tables"] if block_tables is None else block_tables,
        slot_mapping=views["slot_mapping"], query_start_tensor=views["query_start"],
        context_lens_tensor=views["context_lens"], max_context_len=max_context_len,
    )
    return DeviceStep(views["input_ids"], views["positions"], batch, views["sample_rows"])
