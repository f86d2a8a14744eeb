"""Attention masks as pictures: rows are queries, columns are keys."""
from __future__ import annotations

import matplotlib.pyplot as plt
import torch
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

VISIBLE, HIDDEN = "#2b6cb0", "#f0f0f0"


def draw_mask(
    ax: Axes,
    grid: torch.Tensor,
    title: str,
    categories: dict[int, tuple[str, str]] | None = None,
    row_labels: list[str] | None = None,
    col_labels: list[str] | None = None,
    legend: bool = True,
) -> None:
    """Draw a [rows, cols] mask. A bool mask shows visible/hidden; an integer grid shows one
    colour per category, e.g. {0: ("hidden", grey), 1: ("sequence 0", blue), 2: ("padding", red)}.
    legend=False leaves the legend to the caller (one for several panels: legend_handles)."""
    if categories is None:
        categories = {0: ("hidden", HIDDEN), 1: ("may attend", VISIBLE)}
    grid = grid.to(torch.int64).cpu()
    codes = sorted(categories)
    index = {code: i for i, code in enumerate(codes)}
    shown = grid.clone().apply_(lambda c: index[c])
    ax.imshow(shown, cmap=ListedColormap([categories[c][1] for c in codes]), vmin=0, vmax=len(codes) - 1,
              interpolation="nearest")
    rows, cols = grid.shape
    ax.set_xticks([x - 0.5 for x in range(1, cols)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, rows)], minor=True)
    if max(rows, cols) <= 48:  # a cell grid helps reading small masks and clutters big ones
        ax.grid(which="minor", color="white", linewidth=0.5)
    ax.tick_params(which="minor", length=0)
    if row_labels:
        ax.set_yticks(range(rows), row_labels, fontsize=7)
    if col_labels:
        ax.set_xticks(range(cols), col_labels, fontsize=7, rotation=90)
    ax.set_xlabel("key (what is attended to)")
    ax.set_ylabel("query (who attends)")
    ax.set_title(title)
    if legend:
        ax.legend(handles=legend_handles(categories, [grid]), loc="upper right", fontsize=7, framealpha=0.9)


def legend_handles(categories: dict[int, tuple[str, str]], grids: list[torch.Tensor]) -> list[Patch]:
    """One legend entry per category that appears in any of the grids."""
    present = set().union(*(set(g.unique().tolist()) for g in grids))
    return [Patch(color=color, label=label) for code, (label, color) in categories.items() if code in present]


def plot_mask(grid: torch.Tensor, title: str, **kwargs) -> plt.Figure:
    """A single mask in its own figure."""
    rows, cols = grid.shape
    fig, ax = plt.subplots(figsize=(min(10, 2 + cols * 0.22), min(10, 1.5 + rows * 0.22)))
    draw_mask(ax, grid, title, **kwargs)
    return fig


def decode_attention_picture(prompt_len: int, steps: int) -> plt.Figure:
    """Rows computed in each forward: the prompt's causal block once, then one row per step."""
    PREFILL, CACHED, DECODE_QUERY = 1, 2, 3
    n = prompt_len + steps
    grid = torch.zeros(n, n, dtype=torch.long)
    grid[:prompt_len, :prompt_len] = PREFILL * torch.ones(prompt_len, prompt_len).tril()
    for row in range(prompt_len, n):
        grid[row, :row] = CACHED
        grid[row, row] = DECODE_QUERY
    fig, ax = plt.subplots(figsize=(6, 6))
    draw_mask(ax, grid, f"KV cache: prefill {prompt_len} tokens once, then 1 query row per step",
              categories={0: ("not computed / future", "#f0f0f0"), PREFILL: ("prefill (one forward)", "#2b6cb0"),
                          CACHED: ("keys read from the cache", "#90cdf4"), DECODE_QUERY: ("the step's new token", "#dd6b20")})
    return fig
