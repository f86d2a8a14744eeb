"""The paged KV cache as pictures: the pool and its block tables at one step, and how much of
the reserved memory holds real tokens under each cache policy (chapter 6)."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle

from minivllm.course.plots.lines import draw_bars

FREE = "#d9d9d9"
COLORS = plt.get_cmap("tab10").colors


def owner_color(request: int) -> tuple[float, float, float]:
    return COLORS[request % len(COLORS)]


def draw_pool(
    ax: Axes, block_tables: dict[int, list[int]], num_cached: dict[int, int], num_blocks: int, block_size: int,
    blocks_per_row: int = 8,
) -> None:
    """The pool as rows of blocks, each block a strip of `block_size` slots. A slot holding a
    token has its owner's colour; an owned slot still empty is a pale tint of it (reserved,
    not yet used: at most block_size - 1 per sequence); a free block is grey."""
    owner = {block: (r, i) for r, table in block_tables.items() for i, block in enumerate(table)}
    for block in range(num_blocks):
        row, col = divmod(block, blocks_per_row)
        x0, y0 = col * (block_size + 1), -row * 1.6  # a one-slot gap between blocks
        for slot in range(block_size):
            if block not in owner:
                color, alpha = FREE, 1.0
            else:
                r, logical = owner[block]
                color = owner_color(r)
                alpha = 1.0 if logical * block_size + slot < num_cached[r] else 0.2
            ax.add_patch(Rectangle((x0 + slot, y0), 1, 1, facecolor=color, alpha=alpha, edgecolor="white", lw=0.5))
        ax.text(x0 + block_size / 2, y0 + 1.05, str(block), ha="center", va="bottom", fontsize=6, color="#555")
    rows = -(-num_blocks // blocks_per_row)
    ax.set_xlim(-0.5, blocks_per_row * (block_size + 1))
    ax.set_ylim(-(rows - 1) * 1.6 - 0.3, 1.6)
    ax.set_aspect("equal")
    ax.axis("off")
    used = sum(num_cached.values())
    held = sum(len(t) for t in block_tables.values()) * block_size
    ax.set_title(f"KV pool: {num_blocks} blocks × {block_size} slots (number = physical block)\n"
                 f"{used} tokens in {held} slots handed out, "
                 f"{num_blocks - len(owner)} blocks free", fontsize=9)


def draw_block_tables(ax: Axes, block_tables: dict[int, list[int]], num_cached: dict[int, int]) -> None:
    """One row per sequence: logical block i -> the physical block it lives in."""
    width = max((len(t) for t in block_tables.values()), default=1)
    for y, (r, table) in enumerate(sorted(block_tables.items())):
        for i, block in enumerate(table):
            ax.add_patch(Rectangle((i, -y), 1, 0.8, facecolor=owner_color(r), edgecolor="white"))
            ax.text(i + 0.5, -y + 0.4, str(block), ha="center", va="center", fontsize=7, color="white", weight="bold")
        ax.text(-0.2, -y + 0.4, f"request {r} ({num_cached[r]} tok)", ha="right", va="center", fontsize=7)
    ax.set_xlim(-4.5, width + 0.2)
    ax.set_ylim(-len(block_tables) + 0.8, 1.2)
    ax.text(width / 2, 1.0, "logical block 0, 1, 2, ... → physical block", ha="center", fontsize=8)
    ax.axis("off")
    ax.set_title("block tables", fontsize=9)


def plot_block_tables(
    block_tables: dict[int, list[int]], num_cached: dict[int, int], num_blocks: int, block_size: int, title: str,
) -> plt.Figure:
    """The pool's occupancy beside the block tables that index it, at one step."""
    blocks_per_row = max(1, round((num_blocks * 2.5 / (block_size + 1)) ** 0.5))  # a pool about 1.6x wider than tall
    rows = -(-num_blocks // blocks_per_row)
    fig, (pool_ax, table_ax) = plt.subplots(
        1, 2, figsize=(12, max(3.5, 0.6 * max(rows, len(block_tables)) + 1.0)), gridspec_kw=dict(width_ratios=[1, 1]))
    draw_pool(pool_ax, block_tables, num_cached, num_blocks, block_size, blocks_per_row)
    draw_block_tables(table_ax, block_tables, num_cached)
    legend = [Patch(color=owner_color(0), label="slot holding a token"),
              Patch(color=owner_color(0), alpha=0.2, label="slot handed out, still empty"),
              Patch(color=FREE, label="free block")]
    pool_ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10)
    return fig


# The vLLM paper (arXiv 2309.06180): reservation-based systems kept 20.4–38.2 % of their reserved
# KV memory in real tokens; paging wastes under 4 %.
PAPER_RESERVED = (0.204, 0.382)
PAPER_PAGED_WASTE = 0.04


def plot_kv_utilisation(
    utilisation: dict[str, float], fit_at_once: dict[str, float], running: dict[str, list[int]], subtitle: str = "",
) -> plt.Figure:
    """Left: share of reserved KV memory holding real tokens, per cache policy, against the vLLM
    paper's range. Right: requests running at each step within the same budget."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(utilisation)
    colors = [COLORS[i % len(COLORS)] for i in range(len(names))]
    draw_bars(left, names, [100 * u for u in utilisation.values()], "% of reserved KV slots holding a real token",
              "KV utilisation (time-averaged over steps)", [f"{u:.1%}" for u in utilisation.values()], colors=colors)
    lo, hi = PAPER_RESERVED
    left.axhspan(100 * lo, 100 * hi, color="#c53030", alpha=0.12,
                 label=f"vLLM paper: reservation-based systems, {lo:.1%}–{hi:.1%}")
    left.axhline(100 * (1 - PAPER_PAGED_WASTE), color="#2f855a", ls="--", lw=1,
                 label=f"vLLM paper: paging wastes under {PAPER_PAGED_WASTE:.0%}")
    left.set_ylim(0, 105)
    left.tick_params(axis="x", rotation=15, labelsize=8)
    left.legend(fontsize=7, loc="lower right")
    for (name, series), color in zip(running.items(), colors):
        right.plot(range(len(series)), series, color=color, lw=1.2, label=f"{name}: {fit_at_once[name]:.1f} at once")
    right.set_xlabel("step")
    right.set_ylabel("requests running")
    right.set_title("Requests that fit in the same KV budget (mean while others queue)", fontsize=10)
    right.legend(fontsize=7)
    right.grid(alpha=0.3)
    if subtitle:
        fig.suptitle(subtitle, fontsize=9)
    return fig
