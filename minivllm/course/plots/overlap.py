"""Async scheduling as pictures (chapter 16): the host and the device taking turns, then
overlapping (a timeline drawn from measured host and device times), and the step time of both
engines against the device time, beside the predictions host + device and max(host, device)."""
from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

PREPARE, FINISH, DEVICE, WAIT = "#2b6cb0", "#63b3ed", "#dd6b20", "#e2e8f0"


def simulate(host_ms: float, device_ms: float, steps: int, overlap: bool) -> list[tuple[str, int, float, float]]:
    """(lane, step, start, end) spans of `steps` steps whose host work (half planning and
    preparing, half finishing) and device work take the given times. Synchronous: plan, run,
    finish, in turn. Overlapped: plan and launch step k, then finish step k-1 (waiting for the
    device if it is not done), as AsyncScheduler.step does."""
    prepare = finish = host_ms / 2
    spans, t, device_end = [], 0.0, 0.0
    ends: list[float] = []
    for k in range(steps):
        spans.append(("host: schedule + prepare", k, t, t + prepare))
        t += prepare
        start = max(t, device_end)
        device_end = start + device_ms
        spans.append(("device", k, start, device_end))
        ends.append(device_end)
        if not overlap:
            spans.append(("host waits", k, t, device_end))
            t = device_end
            spans.append(("host: finish", k, t, t + finish))
            t += finish
        elif k > 0:
            ready = max(t, ends[k - 1])
            if ready > t:
                spans.append(("host waits", k - 1, t, ready))
            spans.append(("host: finish", k - 1, ready, ready + finish))
            t = ready + finish
    return spans


def _timeline(ax, spans: list[tuple[str, int, float, float]], title: str, limit: float) -> None:
    colors = {"host: schedule + prepare": PREPARE, "host: finish": FINISH, "device": DEVICE, "host waits": WAIT}
    for lane, step, start, end in spans:
        y = 0 if lane == "device" else 1
        ax.barh(y, end - start, left=start, height=0.6, color=colors[lane], edgecolor="white")
        if end - start > limit * 0.03 and lane != "host waits":
            ax.text((start + end) / 2, y, str(step), ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([0, 1], ["device", "host"])
    ax.set_xlim(0, limit)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def plot_overlap(result: dict[str, Any], title: str) -> Figure:
    """Left: timelines of a synchronous and an overlapped engine, drawn from the measured host
    and device times of the row whose device time is closest to its host time (the case where
    overlap helps most). Right: measured step times against device time, with the predictions."""
    rows = result["rows"]
    fig = plt.figure(figsize=(13, 4.8))
    grid = fig.add_gridspec(2, 2, width_ratios=[1.4, 1])
    row = min(rows, key=lambda r: abs(r["device_ms"] - r["host_ms"]))
    host, device, steps = row["host_ms"], row["device_ms"], 5
    sync, overlapped = simulate(host, device, steps, False), simulate(host, device, steps, True)
    limit = max(end for *_, end in sync)
    _timeline(fig.add_subplot(grid[0, 0]), sync,
              f"synchronous: host {host:.2f} ms + device {device:.2f} ms per step, in turn", limit)
    ax = fig.add_subplot(grid[1, 0])
    _timeline(ax, overlapped, "async scheduling: step k+1 prepared and launched before step k is finished", limit)
    ax.set_xlabel("ms (drawn from the measured times; the numbers are steps)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (PREPARE, FINISH, DEVICE, WAIT)]
    ax.legend(handles, ["schedule + prepare", "finish (append, outputs)", "device", "host waits"], fontsize=7,
              loc="lower right", ncol=2)
    ax = fig.add_subplot(grid[:, 1])
    x = [r["device_ms"] for r in rows]
    ax.plot(x, [r["sync_ms"] for r in rows], "o-", color="#4a5568", label="synchronous (measured)")
    ax.plot(x, [r["host_plus_device_ms"] for r in rows], "--", color="#4a5568", alpha=0.6, label="host + device")
    ax.plot(x, [r["async_ms"] for r in rows], "o-", color=DEVICE, label="async scheduling (measured)")
    ax.plot(x, [r["max_host_device_ms"] for r in rows], "--", color=DEVICE, alpha=0.6, label="max(host, device)")
    ax.set_xlabel("device time per step (ms)")
    ax.set_ylabel("step time (ms, median)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("step time against device time", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
