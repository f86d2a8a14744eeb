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


def plot_bars(
    names: list[str], values: list[float], ylabel: str, title: str, annotations: list[str] | None = None,
    logy: bool = False, colors: list[str] | None = None, subtitle: str = "",
) -> plt.Figure:
    """One bar per name, each annotated (e.g. '1,234 tok/s · 12×')."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.5))
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
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.tick_params(axis="x", rotation=30)
    ax.grid(axis="y", alpha=0.3)
    return fig
