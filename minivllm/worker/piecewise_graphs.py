"""Steps that carry prompt tokens, replayed in pieces (chapter 9, after the decode graphs).

Why. The decode graphs (cuda_graphs.py) take only steps of one new token per sequence: their
shape is just "how many sequences". A step that carries a prompt chunk has any number of tokens
per sequence, and attention's work depends on how they are split among sequences, so no one
graph fits it; run eagerly, it pays the launch cost of every kernel of every layer again (on
an H200 the nano workload's ~70 steps of 2,048 prompt tokens ran eager). But attention is the
only part of the forward that cares how tokens are grouped into sequences: everything between
two attention calls is token-wise, and its shape is just "how many tokens".

So the forward is cut at attention. For a bucket of N tokens (16, 32, ..., 512, then every 256
up to the step's token budget or 2,048), each stretch between two attention calls is captured as a graph
of its own, L + 1 pieces for L layers:

    piece 0: embed, layer 0 up to q, k, v  | attention 0 | piece 1: o_proj .. layer 1's q, k, v | ... | piece L: .. norm

A step of T <= N tokens copies its ids and positions into the bucket's buffers, then replays
piece 0, runs layer 0's attention eagerly on the first T rows of that piece's q, k, v (exactly
as an eager step would), writes its output into the buffer piece 1 reads, replays piece 1, and
so on. The N - T padding rows run through the token-wise pieces and are dropped: they never
reach attention, so they read and write no KV cache.

The price:
1. Attention still launches eagerly: L calls (about L kernels with Triton) instead of ~1,300
   launches of a 28-layer model, plus one copy per layer of its output into the next piece's
   input.
2. Padding: a step of T tokens computes the token-wise work of its bucket's N. Buckets double up
   to 512 and then grow by 256, so the waste is below half for small steps and below 256 rows for
   large ones, where a step is bound by its matmuls and a few extra rows cost little.
3. Memory and capture time: (L + 1) graphs per bucket. They share one memory pool with the
   decode graphs (they never run at the same time), so the pool holds the largest bucket's
   activations once.

How the cut is made without touching the model. The forward takes the attention as an argument
(model.py), so the capture passes one whose call ends the graph being captured, keeps q, k and v
(outputs of that piece, at addresses that stay fixed), allocates the output buffer, and begins
capturing the next piece before returning that buffer to the forward. The model file never
learns it was cut.

On a CPU there are no graphs: `EagerPieces` stands in with the same buckets, buffers and
padding, and runs the whole forward on the padded buffers with attention applied to the first T
rows only. The tests use it to prove that padding to a bucket and running attention on the real
rows leave transformers' tokens exactly as they were.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from rich.progress import Progress

from minivllm.model import Attention

Forward = Callable[[torch.Tensor, torch.Tensor, Attention], torch.Tensor]


# The largest step captured in pieces. Past it a step's matmuls take milliseconds (2,048 tokens of
# Qwen3-0.6B: ~2.4 TFLOP) and its ~1,300 eager launches are a small share of them, while every bucket
# costs L + 1 captures: larger token budgets (8,192 on a large GPU) run their largest steps eagerly.
MAX_PIECE_TOKENS = 2048


def piece_token_sizes(max_num_batched_tokens: int) -> list[int]:
    """The token counts to capture pieces for: 16, 32, 64, 128, 256, 512, then every 256 up to the
    step's token budget (and the budget itself, if it is not such a size), at most MAX_PIECE_TOKENS."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}")
    largest = min(max_num_batched_tokens, MAX_PIECE_TOKENS)
    sizes = [s for s in (16, 32, 64, 128, 256, 512) if s < largest]
    sizes += range(768, largest, 256)
    return sizes + [largest]


@dataclass
class AttentionSlot:
    """Where one layer's attention sits between two pieces: the q, k, v the piece before it
    wrote ([N, heads, head_dim], fixed addresses) and the buffer the piece after it reads."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor

    def run(self, attention: Attention, num_tokens: int) -> None:
        """Attention on the step's real rows; the padding rows' output keeps whatever it held
        (the token-wise pieces carry it to rows that are dropped)."""
        T = num_tokens
        self.out[:T].copy_(attention(self.layer, self.q[:T], self.k[:T], self.v[:T]))


def _zero_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The warm-up's attention: the pieces' kernels compile and lazy state is set up, and no KV
    cache is touched."""
    return torch.zeros_like(q)


class CudaPieces:
    """One bucket's forward captured as L + 1 CUDA graphs cut at attention (see the module doc)."""

    def __init__(self, forward: Forward, num_tokens: int, device: torch.device, memory_pool: Any):
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.slots: list[AttentionSlot] = []
        self.memory_pool = memory_pool
        # Warm up outside any graph, on a side stream as PyTorch requires (Triton compiles on a
        # kernel's first call; RoPE moves its frequencies to the GPU once).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(self.input_ids, self.positions, _zero_attention)
            self._begin_piece()
            self.output = forward(self.input_ids, self.positions, self._cut)
            self.graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)

    def _begin_piece(self) -> None:
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.memory_pool)

    def _cut(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The attention the forward sees while it is captured: close the piece so far, note where
        its q, k, v are, open the next piece, and hand the forward the buffer it will read."""
        self.graphs[-1].capture_end()
        out = torch.zeros_like(q)  # allocated between captures: an ordinary buffer no piece frees
        self.slots.append(AttentionSlot(layer, q, k, v, out))
        self._begin_piece()
        return out

    def replay(self, num_tokens: int, attention: Attention) -> torch.Tensor:
        """Run the loaded step (input_ids and positions hold its T = num_tokens tokens first):
        piece, attention, piece, ... Returns the final hidden states of the real rows [T, hidden]."""
        for graph, slot in zip(self.graphs, self.slots):
            graph.replay()
            slot.run(attention, num_tokens)
        self.graphs[-1].replay()
        return self.output[:num_tokens]


class EagerPieces:
    """The CPU's stand-in for CudaPieces: the same buffers and padding, the whole forward run
    again at every replay, attention applied to the real rows only."""

    def __init__(self, forward: Forward, num_tokens: int, device: torch.device, memory_pool: Any = None):
        self.forward = forward
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.output = forward(self.input_ids, self.positions, _zero_attention)

    def replay(self, num_tokens: int, attention: Attention) -> torch.Tensor:
        def padded(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            slot = AttentionSlot(layer, q, k, v, torch.zeros_like(q))
            slot.run(attention, num_tokens)
            return slot.out

        self.output = self.forward(self.input_ids, self.positions, padded)
        return self.output[:num_tokens]


class PiecewiseRunner:
    """Replays steps of any token layout, up to the largest bucket, from pieces cut at attention.

    forward(input_ids, positions, attention) -> hidden [T, hidden] is the model's forward (plain
    or fused). cuda: CudaPieces (True) or the CPU's EagerPieces (False). memory_pool: the decode
    graphs' pool, shared (None: a pool of its own on CUDA)."""

    def __init__(self, forward: Forward, device: torch.device, max_num_batched_tokens: int, cuda: bool,
                 memory_pool: Any = None):
        self.sizes = piece_token_sizes(max_num_batched_tokens)
        pieces_class = CudaPieces if cuda else EagerPieces
        if cuda and memory_pool is None:
            memory_pool = torch.cuda.graph_pool_handle()
        self.pieces: dict[int, CudaPieces | EagerPieces] = {}
        with Progress(transient=True) as progress:  # largest first: the others fit in its memory
            task = progress.add_task(f"capturing pieces for {len(self.sizes)} token counts", total=len(self.sizes))
            for size in reversed(self.sizes):
                self.pieces[size] = pieces_class(forward, size, device, memory_pool)
                progress.advance(task)

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest captured token count that holds num_tokens; None if none does (the step
        then runs eagerly)."""
        if num_tokens < 1:
            raise ValueError(f"a step needs at least one token, got {num_tokens}")
        return next((size for size in self.sizes if size >= num_tokens), None)

    def replay(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Run a step of T = len(input_ids) tokens through the pieces of bucket `size`: its ids and
        positions go into the first T rows of the bucket's buffers (the rest keep an earlier step's,
        valid ids and positions whose rows are dropped), attention sees only those T rows.
        Returns the final hidden states [T, hidden]."""
        pieces, T = self.pieces[size], len(input_ids)
        pieces.input_ids[:T].copy_(input_ids)
        pieces.positions[:T].copy_(positions)
        return pieces.replay(T, attention)
