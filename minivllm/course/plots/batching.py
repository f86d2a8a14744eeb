"""Pictures of batching (chapters 3–5): padded, ragged and chunked masks, and the charts that
measure them. Masks are coloured by sequence, so one can follow a sequence across pictures."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch

from minivllm.course.plots.lines import doubling_axis, draw_bars, plot_series
from minivllm.course.plots.masks import HIDDEN, draw_mask, legend_handles

PADDING_KEY, PADDING_QUERY = "#fbd5d5", "#e53e3e"
SEQUENCE_COLORS = ["#2b6cb0", "#2f855a", "#b7791f", "#6b46c1", "#c05621", "#2c7a7b", "#97266d", "#4a5568"]
FIRST_SEQUENCE = 10  # grid code of sequence 0; sequence b is FIRST_SEQUENCE + b
NOT_A_SCORE = -1  # grid code of a cell that no attention computes (left blank)


def categories(num_sequences: int, padding: bool = False) -> dict[int, tuple[str, str]]:
    """Grid codes for draw_mask: hidden, one colour per sequence, and the two kinds of padding."""
    codes = {0: ("hidden", HIDDEN)}
    for b in range(num_sequences):
        codes[FIRST_SEQUENCE + b] = (f"sequence {b}", SEQUENCE_COLORS[b % len(SEQUENCE_COLORS)])
    if padding:
        codes |= {1: ("padding key (hidden)", PADDING_KEY), 2: ("padding query (sees itself only)", PADDING_QUERY)}
    return codes


def shared_legend(fig: plt.Figure, codes: dict[int, tuple[str, str]], grids: list[torch.Tensor]) -> None:
    """One legend under the figure for panels drawn with legend=False (per-panel legends would
    cover small masks)."""
    handles = legend_handles(codes, grids)
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)), fontsize=8, bbox_to_anchor=(0.5, -0.02))


def padded_grid(mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, L, L] codes of a left-padded batch's mask (padded_causal_mask(lengths)): the row's
    colour where a real query sees a real key, padding keys that causality alone would show,
    padding queries seeing themselves."""
    B, L = len(lengths), max(lengths)
    pads = torch.tensor([L - n for n in lengths])[:, None, None]
    is_pad_query = torch.arange(L)[None, :, None] < pads  # [B, L, 1]
    is_pad_key = torch.arange(L)[None, None, :] < pads  # [B, 1, L]
    grid = torch.where(mask, FIRST_SEQUENCE + torch.arange(B)[:, None, None], 0)
    grid[(is_pad_key & torch.ones(L, L, dtype=torch.bool).tril()) & ~is_pad_query] = 1
    grid[is_pad_query & mask] = 2
    return grid


def ragged_grid(mask: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[T, T] codes of the block-diagonal mask (block_diagonal_mask(lengths)), each block in its
    sequence's colour."""
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.where(mask, FIRST_SEQUENCE + seq_id[:, None], 0)


def token_labels(lengths: list[int], padded: bool) -> list[str] | None:
    """'s.i' for token i of sequence s, 'pad' for padding; None when too many to read."""
    L = max(lengths)
    labels = []
    for s, n in enumerate(lengths):
        labels += ["pad"] * ((L - n) if padded else 0) + [f"{s}.{i}" for i in range(n)]
    return labels if len(labels) <= 40 else None


def plot_padded_mask(mask: torch.Tensor, lengths: list[int]) -> plt.Figure:
    """One panel per row of the padded batch: the [L, L] mask that row's attention uses.
    mask: padded_causal_mask(lengths), [B, L, L] (the picture draws the masks it is given)."""
    B, L = len(lengths), max(lengths)
    grids, codes = padded_grid(mask, lengths), categories(B, padding=True)
    fig, axes = plt.subplots(1, B, figsize=(1.5 + B * (0.9 + 0.28 * L), 2.8 + 0.28 * L), squeeze=False)
    for b, (ax, grid) in enumerate(zip(axes[0], grids)):
        labels = ["pad"] * (L - lengths[b]) + [str(i) for i in range(lengths[b])]
        draw_mask(ax, grid, f"row {b}: {lengths[b]} tokens + {L - lengths[b]} padding", codes,
                  row_labels=labels, col_labels=labels, legend=False)
    fig.suptitle(f"Static batch, left-padded to L = {L}: causal × padding ({B} × {L} × {L} scores)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    shared_legend(fig, codes, list(grids))
    return fig


def plot_padded_vs_ragged(padded_mask: torch.Tensor, ragged_mask: torch.Tensor, lengths: list[int]) -> plt.Figure:
    """The same prompts as one flat run: padded (B*L slots, left; padded_mask is
    padded_causal_mask(lengths)) and ragged (T tokens, right; block_diagonal_mask(lengths)).
    Left, each row of the batch is its own [L, L] score matrix, drawn as B squares on the
    diagonal: rows never meet, so the space between the squares is no score at all. Right, the
    block-diagonal mask is one [T, T] matrix: the hidden cells between sequences are scores a
    dense mask computes and throws away."""
    B, L, T = len(lengths), max(lengths), sum(lengths)
    padded = torch.full((B * L, B * L), NOT_A_SCORE)
    for b, grid in enumerate(padded_grid(padded_mask, lengths)):
        padded[b * L:(b + 1) * L, b * L:(b + 1) * L] = grid
    size = min(7.0, 2.0 + 0.22 * B * L)
    fig, (left, right) = plt.subplots(1, 2, figsize=(2 * size + 1, size + 0.6))
    ragged, codes = ragged_grid(ragged_mask, lengths), categories(B, padding=True)
    draw_mask(left, padded, f"padded: {B} rows × {L} = {B * L} slots,\n{B} × {L}² = {B * L * L} scores",
              codes | {NOT_A_SCORE: ("", "white")}, token_labels(lengths, True), token_labels(lengths, True),
              legend=False)
    for b in range(B):  # outline each row's [L, L] matrix
        left.add_patch(plt.Rectangle((b * L - 0.5, b * L - 0.5), L, L, fill=False, edgecolor="#4a5568", linewidth=1))
    draw_mask(right, ragged, f"ragged: {T} tokens, {T * T} scores as one mask,\n"
              f"{sum(n * n for n in lengths)} computed segment by segment", codes,
              token_labels(lengths, False), token_labels(lengths, False), legend=False)
    right.set_xlim(left.get_xlim())  # same scale: the ragged run is the padded one minus the padding
    right.set_ylim(left.get_ylim())
    right.text((T + B * L) / 2, (T + B * L) / 2, f"no padding:\n{B * L - T} fewer slots", ha="center", va="center")
    fig.suptitle("The same prompts as one flat run: padded batch (chapter 3) vs block-diagonal causal mask (chapter 4)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    shared_legend(fig, codes, [padded, ragged])
    return fig


def plot_chunk_masks(masks: list[torch.Tensor]) -> plt.Figure:
    """Left: each chunk's [n, past + n] mask (chunk_mask(n, past), the chunks of one prompt in
    order), one under the other. Right: stacked, they are exactly the causal mask of the whole prompt."""
    chunks = [(mask.shape[1] - mask.shape[0], mask.shape[0]) for mask in masks]  # (past, n)
    prompt_len, chunk_size = masks[-1].shape[1], masks[0].shape[0]
    codes = {0: ("hidden", HIDDEN), 1: ("cached key (earlier chunks)", SEQUENCE_COLORS[0]),
             2: ("this chunk (causal)", SEQUENCE_COLORS[2])}
    side = 2.5 + 0.32 * prompt_len
    fig = plt.figure(figsize=(2 * side + 1, side + 0.3 * len(chunks)))
    layout = fig.add_gridspec(len(chunks), 2, height_ratios=[n for _, n in chunks], hspace=0.9)
    stacked = torch.zeros(prompt_len, prompt_len, dtype=torch.int64)
    for row, ((past, n), mask) in enumerate(zip(chunks, masks)):
        grid = torch.where(mask, torch.where(torch.arange(past + n) < past, 1, 2), 0)
        stacked[past:past + n, :past + n] = grid
        ax = fig.add_subplot(layout[row, 0])
        draw_mask(ax, grid, f"chunk {row}: chunk_mask({n}, past={past})", codes,
                  [str(past + i) for i in range(n)], [str(j) for j in range(past + n)], legend=False)
        ax.set_xlim(-0.5, prompt_len - 0.5)  # one column scale for every chunk
        ax.set_xlabel("")
        ax.set_ylabel("")
    draw_mask(fig.add_subplot(layout[:, 1]), stacked, f"all chunks stacked = causal_mask({prompt_len})", codes,
              legend=False)
    fig.suptitle(f"A {prompt_len}-token prompt prefilled in chunks of {chunk_size} (rows: queries, columns: keys)")
    shared_legend(fig, codes, [stacked])
    return fig


def plot_waste_vs_batch_size(batch_sizes: list[int], waste: list[float], kv_utilisation: list[float],
                             tokens_per_second: list[float], subtitle: str,
                             one_at_a_time: float | None = None) -> plt.Figure:
    """Static batching: what the batch buys (throughput) and what it costs (waste).
    `one_at_a_time`: chapter 2's useful tokens/s on the same workload, drawn as a dashed line."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    plot_series(left, batch_sizes, {"padding waste (% of token slots)": [100 * w for w in waste],
                                    "KV utilisation (% of KV reserved)": [100 * u for u in kv_utilisation]},
                "batch size", "%", "Waste grows with the batch")
    if one_at_a_time:
        right.axhline(one_at_a_time, color="grey", linestyle="--", label="one at a time (chapter 2)")
    plot_series(right, batch_sizes, {"static batching": tokens_per_second}, "batch size", "useful output tokens/s",
                "Useful throughput")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        doubling_axis(ax, batch_sizes)
    fig.suptitle(f"Static batching\n{subtitle}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_ragged_vs_static(names: list[str], tokens_per_second: list[float], tokens: list[int],
                          bytes_by_series: dict[str, list[float]], subtitle: str) -> plt.Figure:
    """Left: useful throughput per stage. Right: memory of attention over T flat tokens."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    kinds = {"static": PADDING_QUERY, "ragged": SEQUENCE_COLORS[0]}  # by the name's first word
    draw_bars(left, names, tokens_per_second, "useful output tokens/s", "Useful throughput, same workload",
              colors=[kinds.get(n.split()[0], "#a0aec0") for n in names])
    plot_series(right, tokens, {k: [b / 2**20 for b in v] for k, v in bytes_by_series.items()},
                "T (tokens in the flat run)", "MiB", "Memory of one layer's attention", logy=True)
    right.set_xscale("log", base=2)
    fig.suptitle(subtitle, fontsize=10)
    fig.tight_layout()
    return fig


def plot_chunk_sweep(chunk_sizes: list[int], peak_score_mib: list[float], ttft: dict[str, list[float]],
                     subtitle: str, whole_prompts: tuple[float, float] | None = None) -> plt.Figure:
    """Chunked prefill: attention memory and time to first token against the chunk size.
    `whole_prompts` (peak MiB, seconds to first token) draws chapter 4's one-step prefill."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    if whole_prompts:
        left.axhline(whole_prompts[0], color="grey", linestyle="--", label="whole prompts (chapter 4)")
        right.axhline(whole_prompts[1], color="grey", linestyle="--", label="whole prompts (chapter 4)")
    plot_series(left, chunk_sizes, {"largest score matrix": peak_score_mib}, "chunk size (tokens)",
                "MiB (fp32, one layer)", "Peak attention scores", logy=True)
    plot_series(right, chunk_sizes, ttft, "chunk size (tokens)", "seconds", "Time to first token")
    right.set_ylim(bottom=0)
    for ax in (left, right):
        doubling_axis(ax, chunk_sizes)
    fig.suptitle(f"Chunked prefill\n{subtitle}", fontsize=10)
    fig.tight_layout()
    return fig
