"""Chapter 14 — when does tensor parallelism pay? A cost model on paper.

A decode step of B sequences (one new token each) on N GPUs costs each rank:

    compute   max(bytes it reads / HBM bandwidth, FLOPs / peak FLOP rate)        (a roofline)
              bytes: its 1/N of the weights, plus its share of the KV cache (B sequences of
              `context` tokens; KV heads split N ways, or replicated when N > KV heads)
              FLOPs: 2 x its 1/N of the parameters x B
    communication
              2 all-reduces per layer and 1 for the embedding, each of B x hidden activations,
              and the gather of the logits on rank 0. A ring all-reduce of b bytes moves
              2 b (N-1)/N bytes through each rank's link, plus a fixed latency per collective:
              t = latency + 2 b (N-1)/N / link bandwidth.

and nothing overlaps (minivllm's engine runs a layer's all-reduce between its matmuls). The
speed-up over one GPU is t(1) / t(N); it *pays* where that is above 1. A model (weights and
KV cache) that does not fit one GPU's memory needs N GPUs whatever the speed-up.

The numbers are a datasheet's, not measurements (`LINKS`, `GPU`); the lesson is their ratio.
All-reduce bytes per token per layer = 2 all-reduces x hidden x bytes per element: 16 KiB for
Llama-2-7B in bf16 (hidden 4,096), 32 KiB for a 70B (hidden 8,192), against 3.35 TB/s of HBM
that each rank spends reading its weights.

Copies or splits? N whole copies of the model (data parallelism: one engine per GPU, a request
goes to one copy) never talk inside a step: each runs one GPU's decode step on ceil(B/N) of the
B sequences, and serves B / t_step tokens per second. Against N splits, a copy pays no
all-reduce but reads the *whole* weights, so N copies read them N times per step where N splits
read them once. Copies win throughput where the all-reduces cost more than those extra weight
reads (small models, slow links, large batches); splits win where weight reads dominate (large
models, small batches). A copy keeps one GPU's step time at B/N sequences, a split shortens the
step: splits win latency wherever their all-reduces are cheap. And a copy must hold the whole
weights and its KV cache in one GPU: where it does not, only splitting serves the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from minivllm.loader import CONFIGS, read_config
from minivllm.model import ModelConfig


@dataclass(frozen=True)
class Link:
    """How the N ranks' all-reduce travels: bandwidth of the slowest link in the ring, per
    direction, per GPU, and the fixed cost of one collective (start-up, synchronisation)."""

    name: str
    ranks: int
    bandwidth: float  # bytes/s
    latency: float  # s per all-reduce, whatever its size
    source: str


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: float  # bytes
    hbm_bandwidth: float  # bytes/s
    flops: float  # dense bf16 FLOP/s
    source: str


GPU = Gpu("H100 SXM 80GB", 80e9, 3.35e12, 989e12, "NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16")

# Bandwidths from the specifications. The latencies are assumptions of the right order for a
# small NCCL all-reduce (about ten microseconds inside a node, more through a NIC, most through
# TCP): they set the cost of the small batches, where the activations are a few kilobytes.
LINKS = [
    Link("8 GPUs, NVLink 4", 8, 450e9, 10e-6,
         "NVIDIA H100 SXM datasheet: NVLink 900 GB/s per GPU, both directions together"),
    Link("8 GPUs, PCIe 5.0 x16", 8, 64e9, 20e-6, "PCI-SIG: 32 GT/s x 16 lanes, about 64 GB/s per direction"),
    Link("2 nodes x 8, InfiniBand NDR", 16, 50e9, 25e-6,
         "one 400 Gb/s NDR NIC per GPU (as in a DGX H100): 50 GB/s between the nodes"),
    Link("2 nodes x 8, 100 Gb/s Ethernet", 16, 12.5e9, 60e-6,
         "one 100 Gb/s Ethernet port per node: 12.5 GB/s between the nodes"),
]

# decode_step on one GPU never touches its link; copies are given this one to say so.
NO_LINK = Link("no link", 1, math.inf, 0.0, "a single GPU: nothing to talk to")


@dataclass(frozen=True)
class Shape:
    """What the cost model needs of a model (all of it from a ModelConfig)."""

    name: str
    parameters: int
    hidden: int
    layers: int
    vocab: int
    kv_heads: int
    kv_bytes_per_token: int  # at `element` bytes per value

    @classmethod
    def of(cls, name: str, config: ModelConfig, element: int = 2) -> Shape:
        kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element
        return cls(name, config.num_parameters(), config.hidden_size, config.num_layers, config.vocab_size,
                   config.num_kv_heads, kv)


def allreduce_bytes_per_token_per_layer(hidden: int, element: int = 2) -> int:
    """What one token sends into the all-reduces of one layer: 2 (attention, MLP) x hidden values."""
    return 2 * hidden * element


def ring_allreduce_seconds(nbytes: float, ranks: int, link: Link) -> float:
    """One ring all-reduce of `nbytes` over `ranks` ranks: its latency, and 2 b (N-1)/N bytes
    through each rank's link (none at all on one rank)."""
    if ranks == 1:
        return 0.0
    return link.latency + 2 * nbytes * (ranks - 1) / ranks / link.bandwidth


def decode_step(shape: Shape, batch: int, ranks: int, link: Link, context: int = 1024, element: int = 2,
                gpu: Gpu = GPU) -> dict[str, float]:
    """One decode step of `batch` sequences of `context` tokens on `ranks` GPUs: each rank's
    compute and communication seconds, and the memory each rank needs (bytes)."""
    kv_share = min(ranks, shape.kv_heads)  # KV heads split this many ways; past that, replicated
    weights = shape.parameters * element / ranks
    kv = batch * context * shape.kv_bytes_per_token / kv_share
    compute = max((weights + kv) / gpu.hbm_bandwidth, 2 * shape.parameters * batch / ranks / gpu.flops)
    activations = batch * shape.hidden * element
    comm = (2 * shape.layers + 1) * ring_allreduce_seconds(activations, ranks, link)
    if ranks > 1:  # the logits' gather: rank 0 receives N-1 shares of batch x vocab
        comm += link.latency + batch * shape.vocab * element * (ranks - 1) / ranks / link.bandwidth
    return dict(compute=compute, comm=comm, seconds=compute + comm, memory=weights + kv)


def speedup_grid(shapes: list[Shape], batches: list[int], link: Link, context: int = 1024,
                 gpu: Gpu = GPU) -> dict[str, np.ndarray]:
    """For every (shape, batch): t(1 GPU) / t(link.ranks GPUs), and whether it fits one GPU and
    the N GPUs. Cells that do not fit N GPUs are NaN."""
    speedup = np.full((len(shapes), len(batches)), np.nan)
    fits_one = np.zeros_like(speedup, dtype=bool)
    comm_share = np.full_like(speedup, np.nan)
    for i, shape in enumerate(shapes):
        for j, batch in enumerate(batches):
            one = decode_step(shape, batch, 1, link, context, gpu=gpu)
            many = decode_step(shape, batch, link.ranks, link, context, gpu=gpu)
            fits_one[i, j] = one["memory"] <= gpu.memory
            if many["memory"] <= gpu.memory:
                speedup[i, j] = one["seconds"] / many["seconds"]
                comm_share[i, j] = many["comm"] / many["seconds"]
    return dict(speedup=speedup, fits_one=fits_one, comm_share=comm_share)


def tokens_per_second(step: dict[str, float], batch: int, gpu: Gpu = GPU) -> float:
    """`batch` new tokens per step of step["seconds"]; NaN where one GPU's share does not fit its memory."""
    return batch / step["seconds"] if step["memory"] <= gpu.memory else math.nan


def copies_step(shape: Shape, batch: int, copies: int, context: int = 1024, element: int = 2,
                gpu: Gpu = GPU) -> dict[str, float]:
    """One decode step of `batch` sequences spread over `copies` whole copies of the model, one GPU
    each: the busiest copy's one-GPU step on ceil(batch / copies) sequences (the others finish no
    later), and the memory one copy needs: all the weights plus its sequences' KV cache."""
    return decode_step(shape, -(-batch // copies), 1, NO_LINK, context, element, gpu)


def copies_or_splits(shapes: list[Shape], batches: list[int], link: Link, context: int = 1024,
                     gpu: Gpu = GPU) -> dict[str, dict[str, np.ndarray]]:
    """For every (shape, batch), three ways to serve `batch` sequences: "one GPU", link.ranks
    "copies" and a link.ranks-way "split" over `link`. Each gives "tokens_per_second" and
    "step_seconds" (a token's latency), NaN where the model and its KV cache do not fit."""
    grid = {way: {key: np.full((len(shapes), len(batches)), np.nan) for key in ("tokens_per_second", "step_seconds")}
            for way in ("one GPU", "copies", "split")}
    for i, shape in enumerate(shapes):
        for j, batch in enumerate(batches):
            steps = {"one GPU": decode_step(shape, batch, 1, NO_LINK, context, gpu=gpu),
                     "copies": copies_step(shape, batch, link.ranks, context, gpu=gpu),
                     "split": decode_step(shape, batch, link.ranks, link, context, gpu=gpu)}
            for way, step in steps.items():
                rate = tokens_per_second(step, batch, gpu)
                grid[way]["tokens_per_second"][i, j] = rate
                grid[way]["step_seconds"][i, j] = step["seconds"] if not math.isnan(rate) else math.nan
    return grid


# Larger shapes than minivllm/configs/ ships, from Meta's published configurations: vocabulary,
# hidden, intermediate, layers, heads, KV heads, head dim, context.
LARGE_SHAPES = {
    "Llama-2-13B": ModelConfig("llama", 32000, 5120, 13824, 40, 40, 40, 128, 4096),
    "Llama-3-70B": ModelConfig("llama", 128256, 8192, 28672, 80, 64, 8, 128, 8192),
    "Llama-3.1-405B": ModelConfig("llama", 128256, 16384, 53248, 126, 128, 8, 128, 131072),
}
SHIPPED_SHAPES = {"Qwen3-0.6B": "qwen3-0.6b", "Llama-3.2-1B": "llama-3.2-1b", "Llama-2-7B": "llama-2-7b"}


def model_shapes(element: int = 2) -> list[Shape]:
    """From 0.6B to 405B parameters: minivllm/configs/' shapes, then LARGE_SHAPES."""
    shapes = [Shape.of(name, read_config(CONFIGS / f"{file}.json"), element) for name, file in SHIPPED_SHAPES.items()]
    return shapes + [Shape.of(name, config, element) for name, config in LARGE_SHAPES.items()]
