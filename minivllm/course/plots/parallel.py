"""Tensor parallelism as pictures (chapter 14): one layer's weights cut across ranks with its
two all-reduces, a step's time split into compute and communication, and the cost model's
verdict on where splitting a model across GPUs pays, and where whole copies serve more."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle
from matplotlib.ticker import FuncFormatter, NullFormatter

RANK_COLORS = ["#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#d53f8c", "#319795", "#b7791f", "#718096"]
COMPUTE, COMM = "#4a5568", "#e53e3e"


def rank_color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _matrix(ax, x: float, y: float, entry: dict[str, Any], scale: float) -> float:
    """Draw A = W^T of one linear layer ([in, out]: input features down, output features across),
    centred on height y, each rank's share coloured; return its width."""
    width, height = entry["out_features"] * scale, entry["in_features"] * scale
    bottom = y - height / 2
    owners: dict[tuple[int, int], list[int]] = {}
    for rank, span in enumerate(entry["ranks"]):
        owners.setdefault(tuple(span), []).append(rank)
    for (start, end), ranks in owners.items():
        if entry["kind"] == "column":  # output features: vertical bands
            (bx, by), bw, bh = (x + start * scale, bottom), (end - start) * scale, height
        else:  # input features: horizontal bands, from the top
            (bx, by), bw, bh = (x, bottom + height - end * scale), width, (end - start) * scale
        ax.add_patch(Rectangle((bx, by), bw, bh, facecolor=rank_color(ranks[0]), edgecolor="white", lw=1.5,
                               hatch="//" if len(ranks) > 1 else None, alpha=0.85))
        ax.text(bx + bw / 2, by + bh / 2, ",".join(map(str, ranks)), ha="center", va="center", fontsize=7,
                color="white", weight="bold", rotation=90 if bw < 0.3 and len(ranks) > 1 else 0)
    ax.add_patch(Rectangle((x, bottom), width, height, fill=False, edgecolor="#2d3748", lw=1.2))
    ax.text(x + width / 2, bottom - 0.1, f"{entry['name']}\n{entry['in_features']}\n×{entry['out_features']}",
            ha="center", va="top", fontsize=6.5)
    return width


def _arrow(ax, x: float, y: float, length: float, color: str = "#4a5568") -> None:
    ax.annotate("", xy=(x + length, y), xytext=(x, y), arrowprops=dict(arrowstyle="->", color=color))


def plot_sharded_layer(layout: Sequence[dict[str, Any]], world_size: int, title: str) -> plt.Figure:
    """One decoder layer's weight matrices as Megatron draws them, A = W^T ([in, out]), each
    rank's share in its colour and numbered (a hatched band: a KV head several ranks hold), and
    the two all-reduces after the row-parallel o_proj and down_proj.
    layout: bench.tensor_parallel.shard_layout."""
    entries = {e["name"]: e for e in layout}
    scale = 2.6 / max(max(e["in_features"], e["out_features"]) for e in layout)  # one scale for every matrix
    rows = [(["q_proj", "k_proj", "v_proj"], "attention, per head", "o_proj", "all-reduce 1"),
            (["gate_proj", "up_proj"], "SiLU(gate)·up, per feature", "down_proj", "all-reduce 2")]
    fig, ax = plt.subplots(figsize=(12, 6.5))
    right = 0.0
    for row, (inputs, middle, output, reduce) in enumerate(rows):
        y = -row * 3.4
        ax.text(0, y, "x [T, h]\nwhole, on\nevery rank", ha="center", va="center", fontsize=8)
        top = y + max(entries[n]["in_features"] for n in inputs + [output]) * scale / 2 + 0.15
        x = 0.7
        group = x
        for name in inputs:
            x += _matrix(ax, x, y, entries[name], scale) + 0.35
        ax.text((group + x - 0.35) / 2, top, "column-parallel:\neach rank its output features",
                ha="center", va="bottom", fontsize=8, color="#2d3748")
        _arrow(ax, x, y, 0.4)
        ax.text(x + 1.45, y, middle + "\n(no communication)", ha="center", va="center", fontsize=7.5, color="#4a5568")
        x += 2.6
        width = _matrix(ax, x, y, entries[output], scale)
        ax.text(x + width / 2, top, "row-parallel: each rank its input\nfeatures; a partial sum of the output",
                ha="center", va="bottom", fontsize=8, color="#2d3748")
        x += width + 0.15
        _arrow(ax, x, y, 0.45, COMM)
        ax.add_patch(FancyBboxPatch((x + 0.5, y - 0.4), 1.9, 0.8, boxstyle="round,pad=0.05", facecolor="#fed7d7",
                                    edgecolor=COMM, lw=1.5))
        ax.text(x + 1.45, y, f"{reduce}\nadds the [T, h]\npartial sums", ha="center", va="center", fontsize=8,
                color="#9b2c2c", weight="bold")
        right = max(right, x + 2.6)
    handles = [Patch(facecolor=rank_color(r), label=f"rank {r}") for r in range(world_size)]
    if any(len({tuple(s) for s in e["ranks"]}) < world_size for e in layout):
        handles.append(Patch(facecolor="#a0aec0", hatch="//", edgecolor="white", label="the same KV head on several ranks"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(handles), fontsize=8,
              frameon=False)
    ax.set_xlim(-0.6, right)
    ax.set_ylim(-3.4 - 1.9, 2.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return fig


def plot_step_split(rows: Sequence[dict[str, Any]], title: str) -> plt.Figure:
    """A step's time per tensor-parallel size N, as compute and communication (stacked bars),
    with the throughput each size reached. rows: bench.tensor_parallel.run_size results
    (their `label`, if any, names the bar)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    labels = [r.get("label") or f"N = {r['size']}\n({r['threads_per_rank']} thread{'s' * (r['threads_per_rank'] > 1)}"
              f" per rank)" for r in rows]
    compute = np.array([r["compute_seconds"] for r in rows]) * 1e3
    comm = np.array([r["comm_seconds"] for r in rows]) * 1e3
    x = np.arange(len(rows))
    ax.bar(x, compute, color=COMPUTE, label="compute (and the host's own work)")
    ax.bar(x, comm, bottom=compute, color=COMM, label="communication (rank 0 inside its collectives)")
    for i, r in enumerate(rows):
        total = compute[i] + comm[i]
        ax.text(i, total * 1.02, f"{total:.1f} ms/step\n{r['tokens_per_second']:,.0f} tok/s"
                + (f"\n{comm[i] / total:.0%} communication" if comm[i] else ""), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("time per step (ms)")
    ax.set_ylim(0, max(compute + comm) * 1.35)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_tp_cost(grids: Sequence[dict[str, np.ndarray]], links: Sequence[Any], model_names: Sequence[str],
                 batches: Sequence[int], title: str) -> plt.Figure:
    """One heatmap per interconnect: the cost model's speed-up of N GPUs over one, for each model
    (rows) and batch size (columns); blue pays, red loses. A cell marked † does not fit one GPU
    (the speed-up is against an imaginary GPU with room for it); a grey cell does not fit the N
    GPUs either. grids[i]: bench.tp_cost.speedup_grid for links[i]."""
    cols = 2
    rows = -(-len(grids) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.6 * rows + 1.0), squeeze=False, sharey=True,
                             gridspec_kw=dict(hspace=0.55, wspace=0.06))
    norm = TwoSlopeNorm(vmin=np.log2(1 / 8), vcenter=0.0, vmax=np.log2(16))
    image = None
    for ax, grid, link in zip(axes.flat, grids, links):
        speedup = grid["speedup"]
        shown = np.ma.masked_invalid(np.log2(speedup))
        cmap = plt.get_cmap("RdBu").with_extremes(bad="#e2e8f0")  # grey: does not fit
        image = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto")
        for i in range(speedup.shape[0]):
            for j in range(speedup.shape[1]):
                if np.isnan(speedup[i, j]):
                    ax.text(j, i, "does not fit", ha="center", va="center", fontsize=6.5, color="#718096")
                    continue
                mark = "" if grid["fits_one"][i, j] else "†"
                ax.text(j, i, f"{speedup[i, j]:.2g}×{mark}", ha="center", va="center", fontsize=7.5,
                        color="white" if abs(np.log2(speedup[i, j])) > 1.6 else "#1a202c")
        ax.set_xticks(range(len(batches)), [str(b) for b in batches], fontsize=8)
        ax.set_yticks(range(len(model_names)), model_names, fontsize=8)
        ax.tick_params(axis="y", labelleft=ax in axes[:, 0])
        ax.set_xlabel("sequences decoding together (batch)", fontsize=8)
        ax.set_title(f"{link.name}: tensor_parallel_size={link.ranks}\n{link.bandwidth / 1e9:,.1f} GB/s per GPU, "
                     f"{link.latency * 1e6:.0f} µs per all-reduce", fontsize=8.5)
    for ax in list(axes.flat)[len(grids):]:
        ax.axis("off")
    bar = fig.colorbar(image, ax=axes, shrink=0.8, ticks=np.log2([1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16]))
    bar.ax.set_yticklabels(["1/8×", "1/4×", "1/2×", "1×", "2×", "4×", "8×", "16×"], fontsize=8)
    bar.set_label("decode step speed-up over one GPU", fontsize=8)
    fig.suptitle(title, fontsize=9.5, y=0.995)
    return fig


def plot_copies_or_splits(rows: Sequence[dict[str, Any]], title: str) -> plt.Figure:
    """Output tokens per second of each layout (one engine, copies, splits) on the same workload,
    one bar each, with the processes and CPU threads each used. rows: bench.data_parallel results."""
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    names = [row["layout"] for row in rows]
    rates = [row["output_tokens_per_s"] for row in rows]
    colors = ["#718096" if row["processes"] == 1 else rank_color(0 if "copies" in row["layout"] else 1) for row in rows]
    bars = ax.barh(names[::-1], rates[::-1], color=colors[::-1])
    for bar, row in zip(bars, rows[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                f" {row['output_tokens_per_s']:,.0f} tok/s  ({row['processes']} process{'es' * (row['processes'] > 1)},"
                f" {row['threads_each']} thread{'s' * (row['threads_each'] > 1)} each)", va="center", fontsize=8)
    ax.set_xlabel("output tokens per second (higher is better)")
    ax.set_xlim(0, max(rates) * 1.6)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _first_missing(batches: Sequence[int], values: np.ndarray) -> str:
    """Where a series stops fitting: "" (it always fits), "at any batch" or "from B = b"."""
    missing = [b for b, v in zip(batches, values) if np.isnan(v)]
    if not missing:
        return ""
    return "at any batch" if len(missing) == len(batches) else f"from B = {missing[0]:,}"


def plot_copies_or_splits_cost(grids: Sequence[dict[str, dict[str, np.ndarray]]], links: Sequence[Any],
                               model_names: Sequence[str], batches: Sequence[int], title: str) -> plt.Figure:
    """The cost model's copies against splits, one column per model: tokens per second (top) and
    ms per decode step, a token's latency (bottom), against the batch, for one GPU, N copies and an
    N-way split over each link (solid, then dashed). A line stops where its GPUs cannot hold the
    model and its KV cache; the panel says from which batch. grids[i]: bench.tp_cost.copies_or_splits
    for links[i], all of the same N (one GPU and the copies are the same in every grid)."""
    n = links[0].ranks
    fig, axes = plt.subplots(2, len(model_names), figsize=(3.3 * len(model_names), 7.2), squeeze=False,
                             sharex=True)
    styles = ["-", "--", ":", "-."]
    for col, name in enumerate(model_names):
        series = [("one GPU", "#718096", "-", grids[0]["one GPU"]),
                  (f"{n} copies", rank_color(0), "-", grids[0]["copies"])]
        series += [(f"{n}-way split, {link.name.split(', ')[-1]}", rank_color(1), style, grid["split"])
                   for link, grid, style in zip(links, grids, styles)]
        for row, (key, scale, label) in enumerate([("tokens_per_second", 1.0, "tokens per second"),
                                                   ("step_seconds", 1e3, "ms per step (a token's latency)")]):
            ax = axes[row, col]
            for way, color, style, values in series:
                ax.plot(batches, values[key][col] * scale, style, color=color, marker="o", markersize=3, label=way)
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches[::2], [f"{b:,}" for b in batches[::2]])
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.grid(True, which="major", alpha=0.3)
            ax.tick_params(labelsize=7.5)
            if col == 0:
                ax.set_ylabel(label, fontsize=8.5)
            if row == 1:
                ax.set_xlabel("sequences decoding together (batch B)", fontsize=8)
        axes[0, col].set_title(name, fontsize=9.5)
        # memory does not depend on the link: the first split stands for all of them
        notes = [(f"{way.split(',')[0]}: does not fit {where}", color) for way, color, _, values in series[:3]
                 if (where := _first_missing(batches, values["tokens_per_second"][col]))]
        for k, (note, color) in enumerate(notes):  # bottom right: the curves rise to the right, above it
            axes[0, col].text(0.97, 0.03 + 0.075 * k, note, transform=axes[0, col].transAxes, fontsize=7,
                              color=color, ha="right", va="bottom")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8.5, frameon=False)
    fig.suptitle(title, fontsize=9.5)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    return fig
