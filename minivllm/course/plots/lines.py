"""Line and bar charts for measurements: time per token, throughput, waste, memory."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.axes import Axes


def plot_series(
    ax: Axes, x: list[float], series: dict[str, list[float]], xlabel: str, ylabel: str, title: str,
    logy: bool = False, marker: str = "o",
) -> None:
    """Several named y-series over one x axis."""
    for label, y in series.items():
        ax.plot(x[: len(y)], y, marker=marker, markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()


def doubling_axis(ax: Axes, ticks: list[float], labels: list[str] | None = None) -> None:
    """A log2 x axis labelled at `ticks`: for sweeps whose values double (batch sizes, chunk sizes)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels or [f"{t:g}" for t in ticks])


def draw_bars(
    ax: Axes, names: list[str], values: list[float], ylabel: str, title: str, annotations: list[str] | None = None,
    logy: bool = False, colors: list[str] | None = None,
) -> None:
    """One bar per name on `ax`, each annotated above its top (e.g. '1,234 tok/s · 12×')."""
    bars = ax.bar(names, values, color=colors or "#2b6cb0")
    if logy:
        ax.set_yscale("log")
        ax.set_ylim(top=max(values) * 4)  # headroom for the labels above the tallest bar
    else:
        ax.set_ylim(top=max(values) * 1.2)
    for bar, text in zip(bars, annotations or [f"{v:,.0f}" for v in values]):
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def plot_bars(
    names: list[str], values: list[float], ylabel: str, title: str, annotations: list[str] | None = None,
    logy: bool = False, colors: list[str] | None = None, subtitle: str = "",
) -> plt.Figure:
    """A figure of one bar chart (see draw_bars), names tilted to fit."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.5))
    draw_bars(ax, names, values, ylabel, title + (f"\n{subtitle}" if subtitle else ""), annotations, logy, colors)
    ax.tick_params(axis="x", rotation=30)
    return fig


def plot_vs_peers(
    headline: list[dict], headline_title: str, counts: list[int], speedups: dict[str, list[float]],
    target: float, colors: list[str], subtitle: str = "",
) -> plt.Figure:
    """minivllm against other runners on the same requests.

    Left: useful tokens/s of each runner (`headline` rows: name, tokens_per_second and
    speedup, minivllm first). Right, when more than one workload size was measured: how many
    times faster minivllm is than each peer (`speedups[peer]`, one value per entry of `counts`),
    with the `target` ratio as a dashed line."""
    sweep = len(counts) > 1
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 6.5, 4.8), squeeze=False)
    draw_bars(axes[0][0], [row["name"] for row in headline], [row["tokens_per_second"] for row in headline],
              "useful output tokens / s", headline_title,
              [f"{row['tokens_per_second']:,.0f} tok/s" + (f"\nminivllm is {row['speedup']:.2f}× this" if i else "")
               for i, row in enumerate(headline)], colors=colors)
    if sweep:
        ax = axes[0][1]
        for (peer, values), color in zip(speedups.items(), colors[1:]):
            ax.plot(counts, values, marker="o", color=color, label=f"over {peer}")
            for x, y in zip(counts, values):
                ax.annotate(f"{y:.2f}×", (x, y), fontsize=8, xytext=(5, -3), textcoords="offset points")
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}×")
        ax.axhline(1, color="black", linewidth=0.8)
        doubling_axis(ax, counts)
        ax.set_xlim(counts[0] / 1.3, counts[-1] * 1.3)
        ax.set_ylim(0, 1.2 * max(max(v) for v in speedups.values()))
        ax.set_xlabel("requests in the workload (all arrive at once)")
        ax.set_ylabel("minivllm's useful throughput / the peer's")
        ax.set_title("minivllm's speed-up over each peer, by workload size", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("minivllm vs transformers: same model, prompts and output lengths" + (f"\n{subtitle}" if subtitle else ""),
                 fontsize=10)
    fig.tight_layout()
    return fig
