"""Chapter 14 — the parallel layers, and the one place a sharded model talks to other ranks.

Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053) cuts each layer's weights so that the ranks
exchange data only twice per layer:

    x [T, h], the same on every rank
      -> q/k/v, gate/up   split by COLUMNS: each rank computes its own heads, its own slice of
                          the MLP's width, from the whole x. No communication.
      -> attention, SiLU·mul   per head, per feature: still none.
      -> o_proj, down_proj     split by ROWS: each rank multiplies its slice of the features by
                          its slice of the weight, which is a partial sum of the full output.
      -> all-reduce       the partial sums are added up, and every rank has the full [T, h] again.

The names come from Y = X·A with A = W^T: PyTorch stores a linear layer's weight W as
[out_features, in_features]. "Column-parallel" splits A's columns, the *output* features, which
are the rows of PyTorch's W; "row-parallel" splits A's rows, the *input* features, which are the
columns of W.

The vocabulary is split too: each rank holds ceil(V / N) rows of the embedding (the last rank's
padded with zero rows when N does not divide V), looks up only the tokens it holds, and an
all-reduce adds the ranks' lookups; the LM head computes each rank's share of the logits and
gathers them on rank 0, the only rank that samples.

Every collective of the model is a method of `Communicator` below, which also keeps a tally of
their calls, bytes and time (the chapter's compute/communication split). On a GPU the time is
only the host's (NCCL runs asynchronously); on a CPU, gloo's collectives finish before they
return, so the tally is the time communication costs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function


def _check_split(name: str, size: int, rank: int, world_size: int) -> None:
    for what, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), world_size >= 1; got rank={rank}, world_size={world_size}")
    if size % world_size:
        raise ValueError(f"{world_size} ranks cannot split {size} {name} evenly")


def column_parallel(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """Rank `rank`'s share of `linear` split by columns (Megatron's column-parallel linear).

    linear: an nn.Linear with weight [out_features, in_features] (and bias [out_features] or
    None); rank: this rank, 0 <= rank < world_size; world_size: the number of ranks N.

    Returns a new nn.Linear(in_features, out_features // N) of the same dtype and device whose
    output is outputs rank*k .. (rank+1)*k - 1 of `linear`'s (k = out_features // N): rows
    rank*k .. (rank+1)*k - 1 of the weight, and the same slice of the bias (no bias if linear
    has none). Its weight and bias are new tensors (changing them never changes `linear`).
    Concatenated over the ranks, in rank order, the shards' outputs are linear(x), exactly: no
    communication is needed until a row-parallel layer. Raises ValueError if N does not divide
    out_features, or rank or world_size is not an int in range."""
    _check_split("output features", linear.out_features, rank, world_size)
    # BEGIN SOLUTION
    k = linear.out_features // world_size
    rows = slice(rank * k, (rank + 1) * k)
    shard = nn.Linear(linear.in_features, k, bias=linear.bias is not None,
                      device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(linear.weight[rows])
        if linear.bias is not None:
            shard.bias.copy_(linear.bias[rows])
    return shard.requires_grad_(False)
    # END SOLUTION


def row_parallel(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    """Rank `rank`'s share of `linear` split by rows (Megatron's row-parallel linear), before
    the all-reduce.

    linear: an nn.Linear with weight [out_features, in_features] (and bias [out_features] or
    None); rank: this rank, 0 <= rank < world_size; world_size: the number of ranks N.

    Returns a new nn.Linear(in_features // N, out_features) of the same dtype and device that
    reads only input features rank*k .. (rank+1)*k - 1 (k = in_features // N): its weight is
    columns rank*k .. (rank+1)*k - 1 of linear's weight. The bias is added once, not N times:
    rank 0's shard keeps a copy of it, the others have none. Its weight and bias are new
    tensors (changing them never changes `linear`). Each rank's output is a partial sum; summed
    over the ranks (the all-reduce), shard r applied to x[:, r*k:(r+1)*k] gives linear(x).
    Raises ValueError if N does not divide in_features, or rank or world_size is not an int in
    range."""
    _check_split("input features", linear.in_features, rank, world_size)
    # BEGIN SOLUTION
    k = linear.in_features // world_size
    keeps_bias = linear.bias is not None and rank == 0
    shard = nn.Linear(k, linear.out_features, bias=keeps_bias, device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(linear.weight[:, rank * k:(rank + 1) * k])
        if keeps_bias:
            shard.bias.copy_(linear.bias)
    return shard.requires_grad_(False)
    # END SOLUTION


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of the embedding (and LM head) each rank holds: ceil(V / N); the ranks together
    hold N * ceil(V / N) >= V rows, the ones past V zero padding."""
    return -(-vocab_size // world_size)


def vocab_shard(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows rank*k .. (rank+1)*k - 1 (k = ceil(V / N)) of a [V, h] matrix as a new tensor,
    zero rows where they run past V."""
    k = vocab_rows(weight.shape[0], world_size)
    shard = weight.new_zeros(k, weight.shape[1])
    piece = weight[rank * k:(rank + 1) * k]
    shard[:len(piece)] = piece
    return shard


def vocab_parallel_lookup(input_ids: torch.Tensor, shard: torch.Tensor, start: int) -> torch.Tensor:
    """This rank's part of an embedding lookup when the vocabulary is split across ranks.

    input_ids: [T] int64 token ids of the whole vocabulary; shard: [rows, hidden], rows start ..
    start + rows - 1 of the (padded) embedding matrix, the ones this rank holds; start: the
    token id of the shard's first row.

    Returns a new [T, hidden] tensor of shard's dtype, on its device: row t is
    shard[input_ids[t] - start] when start <= input_ids[t] < start + rows, and zeros otherwise
    (another rank holds that token). Never reads shard outside its rows, whatever the ids
    (an id another rank holds must not be looked up here, not even clamped to a row of this
    shard). Summed over the ranks (the all-reduce), the partial lookups are the full lookup,
    exactly: each token is found on one rank, and the others add zeros."""
    # BEGIN SOLUTION
    local = input_ids - start
    mine = (local >= 0) & (local < shard.shape[0])
    rows = shard[torch.where(mine, local, 0)]  # every index in range; the rows not ours are zeroed next
    return rows.masked_fill(~mine[:, None], 0)
    # END SOLUTION


@dataclass
class CommStats:
    """What the collectives of one process cost so far: calls, bytes of the tensors they carried,
    and the host's seconds inside them (see the module doc for what that means on a GPU)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Communicator:
    """The collectives a sharded model calls, on `group` (None: torch.distributed's default
    group) of world_size ranks, this one being `rank`. Every call is counted in `stats`."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None = None):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.stats = CommStats()

    def _count(self, tensor: torch.Tensor, start: float) -> None:
        self.stats.calls += 1
        self.stats.bytes += tensor.nbytes
        self.stats.seconds += time.perf_counter() - start

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place: every rank gets the same sum."""
        start = time.perf_counter()
        with record_function("all_reduce"):
            dist.all_reduce(x, group=self.group)
        self._count(x, start)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x [R, k] side by side on rank 0, [R, N*k] in rank order; None elsewhere."""
        start = time.perf_counter()
        with record_function("gather"):
            parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
            dist.gather(x.contiguous(), parts, dst=0, group=self.group)
        self._count(x, start)
        return torch.cat(parts, dim=-1) if parts is not None else None


class RowParallelLinear(nn.Module):
    """A row-parallel shard (see row_parallel) followed by the all-reduce that adds the ranks'
    partial sums: the output is the full [T, out_features] on every rank."""

    def __init__(self, shard: nn.Linear, comm: Communicator):
        super().__init__()
        self.shard, self.comm = shard, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.shard(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (vocab_shard) and the all-reduce that completes a lookup."""

    def __init__(self, weight: torch.Tensor, rank: int, comm: Communicator):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [ceil(V/N), h]
        self.start, self.comm = rank * weight.shape[0], comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(vocab_parallel_lookup(input_ids, self.weight, self.start))


class ParallelLMHead(nn.Module):
    """This rank's rows of the LM head: its share of the logits, gathered on rank 0. Returns the
    [R, V] logits on rank 0 (the padding columns past V dropped) and None on the other ranks."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Communicator):
        super().__init__()
        self.weight = weight  # [ceil(V/N), h]: the embedding's own Parameter when the model ties them
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.comm.gather_to_first(F.linear(hidden, self.weight))
        return None if logits is None else logits[:, :self.vocab_size]
