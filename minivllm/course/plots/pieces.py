"""Chapter 9's piecewise graphs: where the forward is cut, and which graphs each step replays."""
from __future__ import annotations

from typing import Any

from matplotlib.patches import Rectangle

from minivllm.course.plots import Figure, plt

PATH_COLORS = {"decode graph": "#2b6cb0", "pieces": "#38a169", "eager": "#dd6b20"}


def plot_piecewise(steps: list[dict[str, Any]], piece_sizes: list[int], subtitle: str = "") -> Figure:
    """Left: a forward of L layers cut at attention (captured pieces between eager attention
    calls, the padding rows stopping at attention). Right: every step of a run, its tokens
    against its index, coloured by what it replayed (ModelRunner.graphs_for): a decode graph,
    the pieces of a token bucket (dotted lines: the buckets), or nothing (eager).

    steps: dicts with "tokens" (the step's new tokens) and "path" (a key of PATH_COLORS)."""
    if not steps:
        raise ValueError("plot_piecewise needs at least one step")
    unknown = {s["path"] for s in steps} - set(PATH_COLORS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; expected {sorted(PATH_COLORS)}")
    fig, (cut, runs) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw=dict(width_ratios=[1.3, 1]))
    x = 0.0
    for i, label in enumerate(["piece 0\nembed, layer 0\nup to q, k, v", "attention 0", "piece 1\no_proj, MLP,\n"
                               "layer 1 to q, k, v", "attention 1", "…", "piece L\n… final norm"]):
        eager, width = label.startswith("attention"), 1.6 if label.startswith("piece") else 1.1
        if label == "…":
            cut.text(x + 0.3, 0.5, "…", ha="center", va="center", fontsize=14)
            x += 0.6
            continue
        color = PATH_COLORS["eager"] if eager else PATH_COLORS["pieces"]
        # The bucket's N rows go through every piece; attention sees only the step's T real rows.
        height = 0.55 if eager else 0.9
        cut.add_patch(Rectangle((x, 0.05), width, height, facecolor=color, alpha=0.25, edgecolor=color))
        if not eager:
            cut.add_patch(Rectangle((x, 0.6), width, 0.35, facecolor="white", alpha=0.6, edgecolor="none",
                                    hatch="///"))
        cut.text(x + width / 2, 0.32, label, ha="center", va="center", fontsize=8)
        x += width + 0.15
    cut.text(0.02, 0.97, "rows 0..T-1: the step's tokens;  hatched rows T..N-1: padding to the bucket",
             transform=cut.transAxes, fontsize=8, va="top")
    cut.set_xlim(-0.1, x)
    cut.set_ylim(0, 1.05)
    cut.axis("off")
    cut.set_title("the forward cut at attention: pieces replayed from graphs, attention run eagerly", fontsize=10)

    for path, color in PATH_COLORS.items():
        chosen = [(i, s["tokens"]) for i, s in enumerate(steps) if s["path"] == path]
        if chosen:
            runs.scatter(*zip(*chosen), s=12, color=color, label=f"{path} ({len(chosen)} steps)")
    for size in piece_sizes:
        runs.axhline(size, color=PATH_COLORS["pieces"], linestyle=":", linewidth=0.7)
    runs.set_yscale("log")
    runs.set_xlabel("step")
    runs.set_ylabel("tokens in the step (log scale)")
    runs.set_title("which graphs each step replays (ModelRunner.graphs_for)", fontsize=10)
    runs.legend(fontsize=8, loc="upper right")
    if subtitle:
        fig.suptitle(subtitle, fontsize=9, y=0.02, va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig
