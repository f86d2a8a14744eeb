"""Decode steps replayed from CUDA graphs (chapter 9).

Why. A decode step of Qwen3-0.6B is about 1,300 small kernels. Launching one costs the host
several microseconds (Python, PyTorch's dispatcher, the driver), more than many of these
kernels take to run, so the GPU spends most of the step waiting for the next launch. A CUDA
graph records every launch of one forward pass once; `replay()` then submits all of them with
one call, and the GPU runs them back to back.

The price: a graph replays exactly what it recorded, the same kernels on the same shapes at
the same memory addresses. So:
1. Inputs live in fixed buffers. Each step copies its inputs into `static` before replaying,
   and the captured forward reads them there.
2. Shapes are fixed. One graph per *batch-size bucket* (1, 2, 4, 8, 16, 32, 48, ...): a step of
   37 sequences replays the 48-row graph, with 11 padding rows whose results are dropped.
   Padding rows read and write a spare KV block that no request owns.
3. Whatever the host sizes, it sizes for the worst case: attention's `max_context_len` is the
   longest context the engine allows (max_model_len) and the block tables are that wide. That
   is thousands of columns for a long-context model (2,560 for Qwen3-0.6B: 5.2 MB at batch
   256), so the graphs read the tables from a device buffer of their own, where row i is
   always at the same place, and a step writes only the columns it uses: its tables, only as
   wide as its longest, travel in the step's one packed copy and are written into the first
   columns of their rows on the device.
4. Nothing inside may ask the GPU a question (no `.item()`, no shape read off a tensor).

Only decode-like steps (one new token per sequence) are captured here: they are almost every
step of serving, and the only ones whose shape is just "how many sequences". Prefill and mixed
steps have any number of tokens per sequence; piecewise_graphs.py replays them from graphs cut
at attention (or they run eagerly, as in chapter 7).

Chapter 12 adds a second shape. With speculation a step is mostly *verify* chunks: each
sequence brings its last token and up to k guesses, and run eagerly such a step pays every
launch again (measured on an H200: a verify step with k = 4 cost 5.97x a replayed decode step
at batch 1). So graphs are keyed by (batch-size bucket, query length q), q in {1, 1 + k}: a
step whose chunks are all at most 1 + k tokens replays the (bucket, 1 + k) graph with every
sequence padded to 1 + k rows, its real tokens first. A padding token writes only the spare
block's first slot and is never sampled, and its context counts all 1 + k rows, so row j of a
sequence sees the keys up to context - (1 + k) + j: its real rows see exactly their own past
(build_step_arrays(..., query_len=q)). Padding rather than falling back to eager for a step
where some sequences guessed fewer than k (an n-gram lookup that found nothing) is the right
trade while the step is bound by launches and memory: up to 1 + k rows of a small batch cost
about what one row costs, and an eager step costs several replays (chapter 12 measures how
much is padding). Attention sizes its work from q and the batch only (PagedBatch.query_len).

On a CPU there are no CUDA graphs: `EagerGraph` stands in for one, with the same buckets,
static buffers and padding, but its replay simply calls the forward again. Tests use it to
prove that bucketing and padding leave transformers' tokens exactly as they were. Which one
runs follows the device of the KV pool (`graph_class_for`): a CUDA graph of CPU tensors would
record no work at all, and its replays would leave the outputs of the capture in place.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch
from rich.progress import Progress

from minivllm.attention.paged import KVPool
from minivllm.request.sequence import Sequence
from minivllm.worker.prepare import (
    StepArrays,
    build_step_arrays,
    device_step,
    to_device,
)

Forward = Callable[[], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs
    (and max_num_seqs itself). Padding a step to the next size wastes at most 15 rows, and the
    number of graphs (each holding its own memory) grows only linearly."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def bucket_for(num_seqs: int, sizes: Seq[int]) -> int:
    """The smallest captured batch size that holds num_seqs sequences.

    sizes: the captured batch sizes, ascending. Returns an element of sizes that is >= num_seqs
    (the padding rows, size - num_seqs, are the waste). Raises ValueError if num_seqs < 1 or no
    size is large enough (such a step must run eagerly instead)."""
    # BEGIN SOLUTION
    if num_seqs < 1:
        raise ValueError(f"a step needs at least one sequence, got {num_seqs}")
    for size in sizes:
        if size >= num_seqs:
            return size
    raise ValueError(f"no captured batch size holds {num_seqs} sequences (largest: {sizes[-1] if sizes else None})")
    # END SOLUTION


class EagerGraph:
    """A stand-in for a CUDA graph where there is none (the CPU): `replay()` runs the forward
    again, eagerly, on whatever the static buffers hold. `output` is its latest result."""

    def __init__(self, forward: Forward, memory_pool: Any = None):
        self.forward = forward
        self.output = forward()

    def replay(self) -> None:
        self.output = self.forward()


class CudaGraph:
    """One forward pass captured as a CUDA graph. `output` is the tensor the captured forward
    wrote; every `replay()` rewrites it in place from the static inputs."""

    def __init__(self, forward: Forward, memory_pool: Any = None):
        # Warm up outside the graph first, on a side stream as PyTorch requires: Triton compiles
        # its kernels on their first call and lazy attributes (RoPE's frequencies on the GPU)
        # are set up; neither may happen during capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # Graphs share one memory pool: they never run at the same time, so the largest one's
        # activations can be reused by all the others.
        with torch.cuda.graph(self.graph, pool=memory_pool):
            self.output = forward()

    def replay(self) -> None:
        self.graph.replay()


def graph_class_for(device: torch.device) -> type:
    """CudaGraph for a pool on a CUDA device, EagerGraph (the stand-in) anywhere else."""
    return CudaGraph if torch.device(device).type == "cuda" else EagerGraph


class GraphRunner:
    """Runs decode steps by replaying the graph of their batch-size bucket (and, with
    speculation, verify steps by replaying the graph of their bucket and query length).

    forward(input_ids, positions, attention) -> hidden [T, hidden] is the model's forward (plain
    or fused); the pool's last block is the spare that padding rows use. graph_class: None for
    the one the pool's device runs (graph_class_for); CudaGraph refuses a pool off CUDA.
    query_lens: the query lengths captured for every bucket, ascending, starting at 1."""

    def __init__(
        self, forward: Callable[..., torch.Tensor], pool: KVPool, attention_class: type, max_num_seqs: int,
        max_model_len: int, graph_class: type | None = None, query_lens: Seq[int] = (1,),
    ):
        graph_class = graph_class or graph_class_for(pool.k.device)
        if graph_class is CudaGraph and pool.k.device.type != "cuda":
            raise ValueError(f"CudaGraph captures CUDA work, and this KV pool is on {pool.k.device}: a capture would "
                             f"record nothing and every replay would return the capture's output. Use EagerGraph there "
                             f"(graph_class=None chooses by device).")
        if list(query_lens) != sorted(set(query_lens)) or query_lens[0] != 1:
            raise ValueError(f"query_lens must be ascending, distinct and start at 1, got {query_lens!r}")
        self.pool, self.block_size = pool, pool.block_size
        self.pad_block = pool.num_blocks - 1
        self.sizes, self.query_lens = graph_batch_sizes(max_num_seqs), list(query_lens)
        q = self.query_lens[-1]
        # Block-table width of the longest context, plus the padding rows a verify chunk may add after it.
        self.width = -(-(max_model_len + q - 1) // self.block_size)
        self.max_context_len = self.width * self.block_size
        device, rows = pool.k.device, self.sizes[-1]
        largest = build_step_arrays([], [], self.block_size, rows, pad_block=self.pad_block, query_len=q)
        # Room for the largest step's packed copy: its fields, tables as wide as they can be, and
        # its sampling rows (q per sequence at most). The graphs read the fields before the
        # tables, which sit at the same offsets in every step of a (bucket, query length).
        self.static = torch.zeros(len(largest.pack(tables=False)) + rows * self.width + rows * q, dtype=torch.int64,
                                  device=device)
        # The block tables the graphs read, [rows, width]: column 0 holds the spare block until a
        # step writes a row, so a padding row reads only the spare. Columns past a row's context may
        # hold block ids of an earlier step: attention never reads them (PagedBatch's contract).
        self.tables = torch.full((rows, self.width), -1, dtype=torch.int64, device=device)
        self.tables[:, 0] = self.pad_block
        self.loaded_query_len = 1  # the query length of the step in the static buffers (load)
        memory_pool = torch.cuda.graph_pool_handle() if graph_class is CudaGraph else None
        self.memory_pool = memory_pool  # shared with the pieces of prompt-carrying steps (piecewise_graphs.py)
        # The decode graphs keyed by their batch size, as in chapter 9; those of longer queries by
        # (batch size, query length).
        self.graphs: dict[int | tuple[int, int], Any] = {}
        keys = [(size, q) for q in reversed(self.query_lens) for size in reversed(self.sizes)]  # largest first:
        with Progress(transient=True) as progress:  # the others fit in its memory
            task = progress.add_task(f"capturing {len(keys)} graphs", total=len(keys))
            for size, q in keys:
                self.graphs[self.key(size, q)] = self._capture(size, q, forward, attention_class, graph_class,
                                                               memory_pool)
                progress.advance(task)

    @staticmethod
    def key(size: int, query_len: int) -> int | tuple[int, int]:
        """Where the graph of this batch size and query length is kept in self.graphs."""
        return size if query_len == 1 else (size, query_len)

    def _capture(self, size: int, query_len: int, forward: Callable[..., torch.Tensor], attention_class: type,
                 graph_class: type, memory_pool: Any) -> Any:
        """Fill the static buffer with `size` padding rows of `query_len` tokens, bind the forward
        to its views, capture."""
        arrays = build_step_arrays([], [], self.block_size, size, pad_block=self.pad_block, query_len=query_len)
        packed = arrays.pack(tables=False)
        to_device(packed, self.static.device, out=self.static[:len(packed)])
        step = device_step(arrays, self.static, self.max_context_len, block_tables=self.tables[:size])
        attention = attention_class(self.pool, dataclasses.replace(step.batch, query_len=query_len))
        return graph_class(lambda: forward(step.input_ids, step.positions, attention), memory_pool)

    def can_run(self, num_new_tokens: Seq[int]) -> bool:
        """Whether a step fits a captured graph: not too many sequences, and no chunk longer than
        the longest query captured (one token each without speculation; 1 + k with it)."""
        return 0 < len(num_new_tokens) <= self.sizes[-1] and max(num_new_tokens) <= self.query_lens[-1]

    def query_len_for(self, num_new_tokens: Seq[int]) -> int:
        """The smallest captured query length that holds the step's longest chunk."""
        longest = max(num_new_tokens)
        return next(q for q in self.query_lens if q >= longest)

    def prepare_step(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]) -> tuple[int, StepArrays, torch.Tensor]:
        """prepare() for any step that can_run: a decode step as prepare() does it; one with longer
        chunks (chapter 12's verify step) padded to its bucket and to query_len_for rows per
        sequence. Returns what prepare() returns; the query length is arrays.num_tokens // size."""
        if all(n == 1 for n in num_new_tokens):
            return self.prepare(seqs)
        size, q = bucket_for(len(seqs), self.sizes), self.query_len_for(num_new_tokens)
        arrays = build_step_arrays(seqs, num_new_tokens, self.block_size, num_rows=size, pad_block=self.pad_block,
                                   query_len=q)
        return size, arrays, self.load(arrays)

    def prepare(self, seqs: Seq[Sequence]) -> tuple[int, StepArrays, torch.Tensor]:
        """Put a decode step of `seqs` (one new token each) into the static buffers, padded to
        its batch-size bucket, ready for that bucket's graph to replay. Runs under
        torch.inference_mode, like every step (the buffers were made under it).

        Returns (the bucket's batch size, the step's host arrays, the part of self.static that
        now holds them). Row i of the padded step is seqs[i]'s token; rows len(seqs).. are
        padding that only touches self.pad_block: build_step_arrays(seqs, [1] * len(seqs),
        self.block_size, num_rows=size, pad_block=self.pad_block). Everything a captured graph
        reads must be rewritten in place: the graph knows the buffers' addresses, not their
        contents. self.load(arrays) makes those copies: the whole step, its tables only as wide
        as the step's longest (arrays.pack()), goes in one copy into the front of self.static
        (to_device(packed, device, out=...)), where the fields the graph reads sit at the offsets
        it captured; then, on the device, the tables of that copy go into the first columns of
        rows 0..size-1 of self.tables. The columns after them keep what earlier steps wrote: a
        step never copies the whole width."""
        # BEGIN SOLUTION
        size = bucket_for(len(seqs), self.sizes)
        arrays = build_step_arrays(seqs, [1] * len(seqs), self.block_size, num_rows=size, pad_block=self.pad_block)
        return size, arrays, self.load(arrays)
        # END SOLUTION

    def load(self, arrays: StepArrays) -> torch.Tensor:
        """Copy a decode step's arrays, already padded to a bucket's rows, into the static buffers
        (see prepare; chapter 14's other ranks call it with the arrays rank 0 planned, so every
        rank replays the same graph). Returns the part of self.static that holds them."""
        packed = arrays.pack()
        flat = to_device(packed, self.static.device, out=self.static[:len(packed)])
        self.loaded_query_len = arrays.num_tokens // len(arrays.context_lens)  # rows per sequence: 1, or 1 + k
        tables = arrays.unpack(flat)["block_tables"]  # [size, W]: W columns, not self.width
        self.tables[:len(tables), :tables.shape[1]].copy_(tables)
        return flat

    def replay(self, size: int, num_seqs: int) -> torch.Tensor:
        """Replay the graph of batch size `size` (and of the query length of the step load() put
        in the static buffer) on that step; the hidden states of the first num_seqs sequences
        (the real ones), query_len rows each: [num_seqs * query_len, hidden]."""
        graph = self.graphs[self.key(size, self.loaded_query_len)]
        graph.replay()
        return graph.output[:num_seqs * self.loaded_query_len]
