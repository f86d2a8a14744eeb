"""The first token under a burst (issue 48): when 128 users arrive at once, how long each one
waits for its first token under each scheduler setting (benchmarks/burst_ttft.py's results)."""
from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import numpy as np


def plot_burst_ttft(results: dict[str, Any]) -> plt.Figure:
    """results: benchmarks/results/48_burst_ttft_cpu.json as a dict: `runs` maps each setting to
    its rounds, each with `ttft` (every request's time to first token, seconds) and its p50/p99.
    Left: the share of users that have their first token by time t (every round's requests
    together), one line per setting. Right: p50 and p99 per setting, a bar for the median over
    rounds and a dot for each round."""
    fig, (cdf_ax, bar_ax) = plt.subplots(1, 2, figsize=(12, 4.6))
    settings = list(results["runs"])
    width = 0.38
    for i, name in enumerate(settings):
        rounds = results["runs"][name]
        ttft = np.sort(np.concatenate([r["ttft"] for r in rounds])) * 1e3
        cdf_ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", color=f"C{i}", label=name)
        for j, (key, hatch) in enumerate((("ttft_p50", ""), ("ttft_p99", "//"))):
            x = i + (j - 0.5) * width
            values = [1e3 * r[key] for r in rounds]
            bar = bar_ax.bar(x, float(np.median(values)), width, color=f"C{i}", alpha=0.55 if j else 0.9, hatch=hatch,
                             edgecolor="black", linewidth=0.5, label=key.removeprefix("ttft_") if i == 0 else None)
            bar_ax.plot([x] * len(values), values, "k.", markersize=5)
            bar_ax.annotate(f"{bar[0].get_height():,.0f}", (x, bar[0].get_height()), ha="center", va="bottom",
                            fontsize=7, xytext=(0, 2), textcoords="offset points")
    cdf_ax.set_xlabel("time to first token (ms)")
    cdf_ax.set_ylabel("share of users with their first token")
    cdf_ax.set_title("Every request's first token, all rounds", fontsize=10)
    cdf_ax.set_ylim(0, 1.02)
    cdf_ax.grid(alpha=0.3)
    cdf_ax.legend(fontsize=8, loc="lower right")
    bar_ax.set_xticks(range(len(settings)), settings, fontsize=8)
    bar_ax.set_ylabel("time to first token (ms)")
    bar_ax.set_title("p50 and p99 (hatched): median over rounds; dots: each round", fontsize=10)
    bar_ax.grid(alpha=0.3, axis="y")
    bar_ax.legend(fontsize=8)
    fig.suptitle(f"{results['users']} users arrive at once ({results['prompt_tokens']:,} prompt tokens, "
                 f"{results['output_tokens_each']} output tokens each): the first token by scheduler setting", fontsize=10)
    fig.tight_layout()
    return fig
