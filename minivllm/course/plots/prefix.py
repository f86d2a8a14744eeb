"""Prefix caching as pictures (chapter 11): block tables that point at the same physical blocks,
and what sharing them saves as the shared part of the prompts grows and as a chat goes on."""
from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from minivllm.course.plots.paging import FREE, owner_color

SHARED = "#f6e05e"  # a block that several block tables hold (no request has this colour)
SETTING_COLORS = {"caching on": "#2b6cb0", "caching off": "#dd6b20"}


def _cell(ax, x: float, y: float, color: str, text: str, hatch: str | None = None, bold: bool = False) -> None:
    edge = "#2d3748" if bold else "#a0aec0" if hatch else "white"  # a hatch is drawn in the edge colour
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge, lw=1.6 if bold else 0.8, hatch=hatch))
    dark = color not in (FREE, "white", SHARED)
    ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=8, weight="bold",
            color="white" if dark else "#2d3748")


def plot_shared_blocks(
    tables: dict[str, list[int]], num_tokens: dict[str, int], ref_counts: Sequence[int], cached: set[int],
    title: str,
) -> plt.Figure:
    """Block tables side by side (top) and the pool of physical blocks (bottom), a line from
    every table entry to the block it names.

    tables: request -> its block table; num_tokens: request -> tokens it holds; ref_counts[b]:
    how many tables hold block b; cached: blocks whose content the cache can find. A block held
    by several tables is drawn in one colour with its count; a free block whose content is
    still findable is hatched (its count is 0: it is evicted only when the pool needs it)."""
    gap = 1.5
    starts, x = {}, 0.0
    for request, table in tables.items():
        starts[request] = x
        x += len(table) + gap
    tables_width, pool_width = x - gap, len(ref_counts) * 1.15
    width = max(tables_width, pool_width)
    table_x0, pool_x0 = (width - tables_width) / 2, (width - pool_width) / 2
    table_y, pool_y = 4.0, 0.0
    fig, ax = plt.subplots(figsize=(max(8.0, 0.5 * width + 1.5), 4.6))
    pool_x = {b: pool_x0 + 1.15 * b for b in range(len(ref_counts))}
    owners = {b: r for r, table in tables.items() for b in table}
    for i, (request, table) in enumerate(tables.items()):
        color = owner_color(i)
        x0 = table_x0 + starts[request]
        for j, block in enumerate(table):
            shared = ref_counts[block] > 1
            _cell(ax, x0 + j, table_y, SHARED if shared else color, str(block), bold=shared)
            ax.plot([x0 + j + 0.5, pool_x[block] + 0.5], [table_y, pool_y + 1], color=color, lw=1.1, alpha=0.6,
                    zorder=0)
        ax.text(x0 + len(table) / 2, table_y + 1.15, f"{request}\n{num_tokens[request]} tokens, {len(table)} blocks",
                ha="center", va="bottom", fontsize=8, color=color)
    colors = {r: owner_color(i) for i, r in enumerate(tables)}
    for block, count in enumerate(ref_counts):
        if count > 1:
            color, hatch = SHARED, None
        elif count == 1:
            color, hatch = colors[owners[block]], None
        else:
            color, hatch = ("white", "///") if block in cached else (FREE, None)
        _cell(ax, pool_x[block], pool_y, color, str(block), hatch, bold=count > 1)
        ax.text(pool_x[block] + 0.5, pool_y - 0.15, f"ref {count}", ha="center", va="top", fontsize=7,
                color="#2d3748" if count else "#a0aec0", weight="bold" if count > 1 else "normal")
    ax.text(width / 2, table_y + 2.3, "block tables: logical block 0, 1, 2, ... → physical block (the number)",
            ha="center", va="bottom", fontsize=8, color="#4a5568")
    ax.text(width / 2, pool_y - 0.75, "the KV pool: physical blocks and their reference counts", ha="center",
            va="top", fontsize=8, color="#4a5568")
    legend = [Patch(facecolor=SHARED, edgecolor="#2d3748", label="held by several requests (computed once)"),
              Patch(facecolor=owner_color(0), label="held by one request"),
              Patch(facecolor="white", edgecolor="#a0aec0", hatch="///",
                    label="free, content kept: found again on a hit, evicted when needed"),
              Patch(facecolor=FREE, label="free, nothing findable (never filled, or a partial block)")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False)
    ax.set_xlim(-0.5, width + 0.5)
    ax.set_ylim(pool_y - 1.2, table_y + 2.9)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)
    return fig


def plot_prefix_sweep(
    shares: list[float], results: dict[str, list[dict]], speedups: list[dict], prompt_len: int, block_size: int,
    title: str,
) -> plt.Figure:
    """What caching changes as the shared part of every prompt grows (x: share of the prompt).

    Top, the time: speedups[i] at shares[i] holds ttft_p50, ttft_p90 (caching off's TTFT over
    caching on's) and tokens_per_second (on's throughput over off's), each the median of
    side-by-side pairs of runs, so a busy machine's drift cancels. Bottom, the work, which does
    not depend on the machine: results[setting][i] holds prompt_tokens_computed and
    peak_kv_blocks."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    x = [100 * s for s in shares]
    (ttft, throughput), (work, memory) = axes
    # p90 as hollow squares around p50's dots: where the two are equal (all requests arrive at once,
    # so they often are), the square still shows that p90 is there.
    ttft.plot(x, [r["ttft_p90"] for r in speedups], "s--", color=SETTING_COLORS["caching on"], markersize=10,
              markerfacecolor="none", alpha=0.7, label="p90 (hollow squares)")
    ttft.plot(x, [r["ttft_p50"] for r in speedups], "o-", color=SETTING_COLORS["caching on"], label="p50")
    throughput.plot(x, [r["tokens_per_second"] for r in speedups], "o-", color=SETTING_COLORS["caching on"])
    for ax, key in ((ttft, "ttft_p50"), (throughput, "tokens_per_second")):
        values = [r[key] for r in speedups]
        for xi, v in zip(x, values):
            ax.annotate(f"{v:.2f}×", (xi, v), fontsize=8, xytext=(4, 4), textcoords="offset points")
        ax.axhline(1, color="gray", lw=1, ls=":", label="no change")
        ax.set_ylabel("caching off / caching on" if ax is ttft else "caching on / caching off")
        ax.set_xlim(min(x) - 5, max(x) + 10)  # room for the last label
    ttft.set_title("time to first token: how many times sooner with the cache\n(all requests arrive at once)",
                   fontsize=10)
    throughput.set_title("useful output throughput: how many times higher with the cache", fontsize=10)
    for setting, rows in results.items():
        color = SETTING_COLORS.get(setting)
        work.plot(x, [r["prompt_tokens_computed"] for r in rows], "o-", color=color, label=setting)
        memory.plot(x, [r["peak_kv_blocks"] for r in rows], "o-", color=color, label=setting)
    work.set_title("prompt tokens computed (from the trace)", fontsize=10)
    work.set_ylabel("tokens")
    memory.set_title(f"peak KV blocks held ({block_size} tokens each)", fontsize=10)
    memory.set_ylabel("blocks")
    for ax in axes.flat:
        ax.set_xlabel(f"shared system prompt, % of each {prompt_len}-token prompt")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left" if ax in (ttft, throughput) else "lower left")
    ttft.set_ylim(top=1.15 * max(1, *(r[k] for r in speedups for k in ("ttft_p50", "ttft_p90"))))
    throughput.set_ylim(top=1.15 * max(1, *(r["tokens_per_second"] for r in speedups)))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_multi_turn(turns: list[dict], title: str) -> plt.Figure:
    """A chat, turn by turn. turns[t] holds prompt_tokens (all conversations' prompts, summed)
    and, per setting, prompt_tokens_computed and ttft_p50 (seconds). Left: the prompt grows each
    turn; without the cache every turn computes all of it, with the cache only what is new.
    Right: the time to the first token of each turn."""
    fig, (work, latency) = plt.subplots(1, 2, figsize=(12, 4.4))
    index = range(1, len(turns) + 1)
    settings = [s for s in SETTING_COLORS if s in turns[0]]
    bar = 0.8 / (len(settings) + 1)
    work.bar([t - 0.4 + bar / 2 for t in index], [t["prompt_tokens"] for t in turns], bar, color="#e2e8f0",
             edgecolor="#a0aec0", label="prompt tokens")
    for k, setting in enumerate(settings, start=1):
        values = [t[setting]["prompt_tokens_computed"] for t in turns]
        bars = work.bar([t - 0.4 + bar * (k + 0.5) for t in index], values, bar, color=SETTING_COLORS[setting],
                        label=f"computed, {setting}")
        for rect, v in zip(bars, values):
            work.annotate(f"{v:,}", (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                          va="bottom", fontsize=7, xytext=(0, 1), textcoords="offset points")
        latency.plot(list(index), [t[setting]["ttft_p50"] for t in turns], "o-", color=SETTING_COLORS[setting],
                     label=f"{setting}, p50")
    work.set_title("prompt tokens per turn, and how many were computed", fontsize=10)
    work.set_ylabel("tokens (all conversations)")
    latency.set_title("time to first token of each turn (the turn's requests arrive at once)", fontsize=10)
    latency.set_ylabel("seconds")
    latency.set_ylim(bottom=0)
    for ax in (work, latency):
        ax.set_xlabel("turn")
        ax.set_xticks(list(index))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
