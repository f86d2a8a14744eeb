"""Pictures of scheduling (chapter 7): who ran in each engine step, what each step was made
of, and how latency grows with the request rate."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minivllm.course.plots.lines import doubling_axis

# One colour per timeline code (see engine/trace.py): idle, waiting, stalled, prefill, decode, preempted.
TIMELINE_COLORS = ["#ffffff", "#d9d9d9", "#f6e05e", "#2b6cb0", "#38a169", "#e53e3e"]
PREFILL_COLOR, DECODE_COLOR = TIMELINE_COLORS[3], TIMELINE_COLORS[4]
POLICY_COLORS = {"continuous": "#2b6cb0", "static": "#dd6b20"}


def plot_timeline(
    request_ids: list[str], grid: list[list[int]], labels: dict[int, str], title: str, marked: int | None = None
) -> plt.Figure:
    """Requests (rows) across engine steps (columns), one colour per state code in `grid`.
    Cells holding the code `marked` (say, a preemption) also get a marker: a state that lasts
    one step is a hairline among hundreds of steps, too thin to see."""
    rows, cols = len(grid), len(grid[0]) if grid else 0
    fig, ax = plt.subplots(figsize=(min(16, 3 + cols * 0.05), min(12, 1.5 + rows * 0.3)))
    ax.imshow(grid, cmap=ListedColormap(TIMELINE_COLORS), vmin=0, vmax=len(TIMELINE_COLORS) - 1,
              aspect="auto", interpolation="nearest")
    ax.set_yticks(range(rows), [f"request {r}" for r in request_ids], fontsize=7)
    ax.set_xlabel("engine step")
    ax.set_title(title, fontsize=10)
    used = {code for row in grid for code in row} - {marked}
    handles = [Patch(facecolor=TIMELINE_COLORS[c], edgecolor="#999999", label=labels[c]) for c in sorted(labels) if c in used]
    cells = [(x, y) for y, row in enumerate(grid) for x, code in enumerate(row) if code == marked]
    if cells:  # the marker's legend entry stands for the code's colour too
        xs, ys = zip(*cells)
        handles += ax.plot(xs, ys, linestyle="none", marker="X", markersize=9, color=TIMELINE_COLORS[marked],
                           markeredgecolor="black", label=f"{labels[marked]} ({len(cells)}×)")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    return fig


def plot_step_composition(prefill: list[int], decode: list[int], budget: int, title: str) -> plt.Figure:
    """Stacked bars: prefill and decode tokens of each step, under the token budget."""
    steps = range(len(prefill))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(steps, decode, width=1.0, color=DECODE_COLOR, label="decode tokens")
    ax.bar(steps, prefill, width=1.0, bottom=decode, color=PREFILL_COLOR, label="prefill tokens")
    ax.axhline(budget, color="#e53e3e", linestyle="--", linewidth=1, label=f"budget ({budget} tokens)")
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the step")
    ax.set_title(title, fontsize=10)
    # A few decode tokens and a full prefill both stay readable: linear up to 4, then logarithmic.
    ax.set_yscale("symlog", linthresh=4)
    ticks = sorted({0, budget} | {2**k for k in range(budget.bit_length()) if 2**k < budget})
    ax.set_yticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_latency_vs_rate(rates: list[float], results: dict[str, list[dict]], title: str) -> plt.Figure:
    """results[policy][i] is latency_summary() at rates[i]: TTFT, TPOT and E2E at p50 (solid)
    and p99 (dashed), and useful throughput, against the request rate."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, metric, name in zip(axes, ("ttft", "tpot", "e2e"), ("time to first token", "time per output token",
                                                                 "end-to-end latency")):
        for policy, summaries in results.items():
            color = POLICY_COLORS.get(policy)
            ax.plot(rates, [s[metric]["p50"] for s in summaries], "o-", color=color, label=f"{policy} p50")
            ax.plot(rates, [s[metric]["p99"] for s in summaries], "o--", color=color, alpha=0.7, label=f"{policy} p99")
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
    throughput = axes[3]
    for policy, summaries in results.items():
        throughput.plot(rates, [s["throughput"]["useful_tokens_per_second"] for s in summaries], "o-",
                        color=POLICY_COLORS.get(policy), label=policy)
    throughput.set_title("useful output throughput", fontsize=10)
    throughput.set_ylabel("tokens / s")
    for ax in axes:
        ax.set_xlabel("request rate (requests / s)")
        doubling_axis(ax, rates)  # rates usually double from one run to the next
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    throughput.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
