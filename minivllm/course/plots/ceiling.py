"""The roofline picture (chapter 9): each runner's throughput against the memory ceiling of
the same workload, and what the floor is made of (weight reads against KV reads)."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from minivllm.course.plots.lines import draw_bars

CEILING_COLOR = "#e53e3e"
WEIGHT_COLOR, KV_COLOR = "#2b6cb0", "#d69e2e"


def plot_roofline(rows: list[dict], floor: dict, subtitle: str = "") -> plt.Figure:
    """rows: one per runner, with name, tokens_per_second, share_of_roofline and (where the GPU
    has a datasheet figure) share_of_datasheet_roofline (the engine's settings first, the peer
    last); floor: minivllm.roofline.Floor.to_dict().

    Left: useful output tokens/s of each runner under the roofline ceiling (dashed), each bar
    labelled with its share of the roofline. Right: the floor's bytes, weight reads against KV
    reads, which says what a faster engine would have to read less of. The throughput axis is
    logarithmic when a runner is below 5% of the ceiling, so that its bar stays visible."""
    if not rows:
        raise ValueError("plot_roofline needs at least one row")
    fig, (ax, parts) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw=dict(width_ratios=[3, 1]))
    ceiling = floor["tokens_per_second"]
    colors = ["#2b6cb0" if not row["name"].startswith("transformers") else "#38a169" for row in rows]
    draw_bars(ax, [row["name"] for row in rows], [row["tokens_per_second"] for row in rows], "useful output tokens / s",
              "throughput against the memory roofline",
              [f"{row['tokens_per_second']:,.0f} tok/s\n" + (
                  f"{row['requests_finished']} requests: no share" if row["share_of_roofline"] is None else
                  f"{row['share_of_roofline']:.1%} of roofline" + ("" if row.get("share_of_datasheet_roofline") is None
                                                                  else f"\n{row['share_of_datasheet_roofline']:.1%} at datasheet"))
               for row in rows],
              colors=colors)
    ax.axhline(ceiling, color=CEILING_COLOR, linestyle="--", linewidth=1.2)
    ax.annotate(f"roofline: {ceiling:,.0f} tok/s (floor {floor['seconds']:.3g} s)", (0.01, ceiling),
                xycoords=("axes fraction", "data"), va="bottom", fontsize=8, color=CEILING_COLOR)
    speeds = [row["tokens_per_second"] for row in rows]
    if min(speeds) < 0.05 * ceiling:
        ax.set_yscale("log")
        ax.set_ylim(min(speeds) / 3, max(ceiling, *speeds) * 4)
    else:
        ax.set_ylim(0, max(ceiling, *speeds) * 1.2)
    ax.tick_params(axis="x", labelsize=8)

    weights = floor["weight_bytes"] * floor["weight_reads"]
    parts.bar(0, weights, color=WEIGHT_COLOR, label=f"weights: {floor['weight_reads']:,} reads of "
                                                   f"{_bytes(floor['weight_bytes'])} = {_bytes(weights)}")
    parts.bar(0, floor["kv_bytes"], bottom=weights, color=KV_COLOR,
              label=f"KV cache reads: {_bytes(floor['kv_bytes'])}")
    parts.set_xticks([])
    parts.set_ylabel("bytes the workload must read")
    parts.yaxis.set_major_formatter(FuncFormatter(lambda n, _: _bytes(n)))
    parts.set_title(f"the floor: {_bytes(floor['total_bytes'])} at {floor['bandwidth'] / 1e9:,.1f} GB/s\n"
                    f"(measured copy bandwidth)", fontsize=9)
    parts.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.02))
    parts.grid(axis="y", alpha=0.3)
    fig.suptitle("How close each runner comes to the memory floor" + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout()
    return fig


def _bytes(n: float) -> str:
    """Decimal units, as bandwidths are quoted (GB/s, TB/s)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"
