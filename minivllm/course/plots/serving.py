"""Serving under load (chapter 10): latency and per-user speed against concurrency or rate,
one line per scheduling policy, with the SLO drawn in and the last level that meets it starred."""
from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from minivllm.course.plots.lines import doubling_axis

COLORS = {"continuous": "#2b6cb0", "static": "#c05621"}


def plot_serving(runs: dict[str, list[dict[str, Any]]], x_key: str, slo_ttft: float, slo_tokens_per_second: float,
                 subtitle: str = "") -> plt.Figure:
    """runs: label -> one summary per level (minivllm.course.bench.load.summarize, plus `x_key`:
    "concurrency" or "rate"). Left: time to first token; middle: tokens/s each user sees
    (1 / TPOT) for the median user and the slowest 1 %; right: output tokens/s of all users."""
    fig, (ttft_ax, speed_ax, total_ax) = plt.subplots(1, 3, figsize=(15, 4.8))
    xs_all: set[float] = set()
    for i, (label, levels) in enumerate(runs.items()):
        levels = [lv for lv in levels if "ttft" in lv and "tpot" in lv]
        if not levels:
            continue
        color = COLORS.get(label, f"C{i + 2}")
        xs = [lv[x_key] for lv in levels]
        xs_all.update(xs)
        ttft = {p: [lv["ttft"][p] * 1e3 for lv in levels] for p in ("p50", "p99")}
        speed = {p: [1 / lv["tpot"][p] for lv in levels] for p in ("p50", "p99")}
        ttft_ax.plot(xs, ttft["p99"], marker="o", color=color, label=f"{label}, p99")
        ttft_ax.plot(xs, ttft["p50"], marker=".", linestyle="--", color=color, alpha=0.7, label=f"{label}, p50")
        speed_ax.plot(xs, speed["p99"], marker="o", color=color, label=f"{label}, slowest 1 %")
        speed_ax.plot(xs, speed["p50"], marker=".", linestyle="--", color=color, alpha=0.7, label=f"{label}, median")
        total_ax.plot(xs, [lv["output_throughput"] for lv in levels], marker="o", color=color, label=label)
        met = [j for j, lv in enumerate(levels) if lv["slo_met"]]
        if met:  # the last level where the SLO still holds
            j = max(met, key=lambda k: xs[k])
            ttft_ax.plot(xs[j], ttft["p99"][j], marker="*", markersize=16, color=color, linestyle="none")
            speed_ax.plot(xs[j], speed["p99"][j], marker="*", markersize=16, color=color, linestyle="none")
    ttft_ax.axhline(slo_ttft * 1e3, color="gray", linestyle=":", label=f"SLO {slo_ttft * 1e3:g} ms")
    speed_ax.axhline(slo_tokens_per_second, color="gray", linestyle=":", label=f"SLO {slo_tokens_per_second:g} tok/s")
    xlabel = "concurrent users (closed loop)" if x_key == "concurrency" else "request rate (requests/s, Poisson)"
    for ax, ylabel, title in (
        (ttft_ax, "time to first token (ms)", "Time to first token"),
        (speed_ax, "tokens/s each user sees (1 / TPOT)", "Per-user speed"),
        (total_ax, "output tokens/s, all users", "Total throughput"),
    ):
        if xs_all:
            doubling_axis(ax, sorted(xs_all))
        if ax is total_ax:
            ax.set_ylim(bottom=0)
        else:  # latencies span orders of magnitude
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # 10, 20, 50, 100, ... in plain numbers
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("Serving over HTTP: where each policy stops meeting the SLO (★ = last level that meets it at p99)"
                 + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout()
    return fig
