"""Pictures for chapter 8: how a kernel walks a paged context, and how fast kernels read memory."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from minivllm.course.plots.lines import doubling_axis

EMPTY = "#f0f0f0"
PARTITION_COLORS = ["#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#d53f8c", "#319795", "#b7791f", "#718096"]


def plot_paged_tiles(block_table: list[int], context_len: int, block_size: int, num_blocks: int, block_n: int,
                     partition_size: int) -> plt.Figure:
    """One sequence's context as the decode kernel sees it (top: logical order, coloured by
    the partition, i.e. the program, that reads each token; lines mark BLOCK_N tiles) and
    where those tokens really are (bottom: the pool, one row per physical block)."""
    partition = np.arange(context_len) // partition_size
    colors = ListedColormap([EMPTY] + [PARTITION_COLORS[i % len(PARTITION_COLORS)]
                                       for i in range(int(partition.max()) + 1)])
    pool = np.zeros((num_blocks, block_size), dtype=int)  # 0 = a slot this sequence does not use
    for p in range(context_len):
        pool[block_table[p // block_size], p % block_size] = partition[p] + 1

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 2 + 0.28 * num_blocks),
                                      gridspec_kw=dict(height_ratios=[1, max(2, num_blocks / 3)]))
    top.imshow((partition + 1)[None, :], cmap=colors, vmin=0, vmax=colors.N - 1, aspect="auto",
               interpolation="nearest")
    for edge in range(block_size, context_len, block_size):
        top.axvline(edge - 0.5, color="black", linewidth=0.6, linestyle=":")
    for edge in range(block_n, context_len, block_n):
        top.axvline(edge - 0.5, color="white", linewidth=2)
    top.set_yticks([])
    top.set_xlabel("token position in the sequence (white lines: BLOCK_N-token tiles; dotted: blocks)")
    top.set_title(f"decode kernel: {context_len} tokens, tiles of {block_n}, partitions of {partition_size} "
                  f"(one colour per program)", fontsize=10)
    bottom.imshow(pool, cmap=colors, vmin=0, vmax=colors.N - 1, aspect="auto", interpolation="nearest")
    for logical, physical in enumerate(block_table[:-(-context_len // block_size)]):
        first = logical * block_size
        last = min(first + block_size, context_len) - 1
        bottom.text(-0.4, physical, f"logical block {logical}: tokens {first}–{last}", va="center", fontsize=7,
                    bbox=dict(facecolor="white", alpha=0.75, edgecolor="none", pad=1))
    bottom.set_xlabel("slot in block")
    bottom.set_ylabel("physical block")
    bottom.set_yticks(range(num_blocks))
    bottom.tick_params(axis="y", labelsize=7)
    bottom.set_title(f"the same tokens in the KV pool (block table {block_table})", fontsize=9)
    fig.tight_layout()
    return fig


def plot_bandwidth(x: list[int], seconds: dict[str, list[float | None]], bandwidth: dict[str, list[float | None]],
                   ceiling: float, xlabel: str, title: str, subtitle: str = "") -> plt.Figure:
    """Kernel time (left) and achieved bandwidth (right) of several implementations over one
    swept size, with the measured copy bandwidth as the ceiling. None marks a missing point."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in seconds:
        t = [np.nan if s is None else s * 1e3 for s in seconds[name]]
        b = [np.nan if g is None else g for g in bandwidth[name]]
        left.plot(x, t, marker="o", markersize=3, label=name)
        right.plot(x, b, marker="o", markersize=3, label=name)
    right.axhline(ceiling, color="black", linestyle="--", linewidth=1, label=f"copy bandwidth {ceiling:,.0f} GB/s")
    right.axhline(0.9 * ceiling, color="grey", linestyle=":", linewidth=1, label="90 % of copy (the goal at long contexts)")
    for ax, ylabel in ((left, "time per call (ms)"), (right, "achieved bandwidth (GB/s)")):
        doubling_axis(ax, x, [f"{v:,}" for v in x])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    left.set_yscale("log")
    right.legend(fontsize=8)
    fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout()
    return fig
