"""Pictures of where an engine step's time goes (chapter 9).

Both functions read profiles in the JSON form `minivllm.course.bench.profiling.StepProfile.to_dict()`
writes (and benchmarks/results/09_step_profile_*.json holds): a step's spans are
[name, start_ms, end_ms] lists, measured from the step's start.
"""
from __future__ import annotations

import re
import statistics
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch

PHASE_COLORS = {"schedule": "#805ad5", "prepare": "#dd6b20", "forward": "#2b6cb0", "sample": "#38a169",
                "finish": "#d69e2e", "other": "#cbd5e0"}
# What an operator or kernel does, guessed from its name (aten ops on the host, kernels on a GPU).
CATEGORY_COLORS = {"matmul": "#2c5282", "attention": "#d53f8c", "copy, index, allocate": "#ed8936",
                   "elementwise and the rest": "#a0aec0", "CUDA runtime call": "#38a169"}
_MATMUL = re.compile(r"gemm|gemv|matmul|linear|\bmm\b|addmm|bmm|nvjet|xmma|cutlass|cublas")
_ATTENTION = re.compile(r"attention|attn|flash|paged|sdpa|softmax")
_COPY = re.compile(r"copy|index|gather|scatter|\bcat\b|memcpy|memset|\bto\b|fill|embedding|empty|clone|contiguous|"
                   r"slice|select|view|reshape|transpose|unsqueeze|flatten|lift_fresh|alias|as_strided")
LANES = ("engine phases\n(host)", "decoder layers\n(host)", "operator calls\n(host)", "kernels\n(device)")


def op_category(name: str) -> str:
    """The CATEGORY_COLORS key for an operator or kernel name."""
    n = name.lower()
    if n.startswith("cu") and not n.startswith(("cutlass", "cublas")):
        return "CUDA runtime call"
    for category, pattern in (("matmul", _MATMUL), ("attention", _ATTENTION), ("copy, index, allocate", _COPY)):
        if pattern.search(n):
            return category
    return "elementwise and the rest"


def _bars(ax: Axes, y: float, spans: list, color_of: Any, height: float = 0.7) -> None:
    """One horizontal lane of spans, drawn in one call per colour (steps have thousands)."""
    by_color: dict[str, list[tuple[float, float]]] = {}
    for name, start, end in spans:
        by_color.setdefault(color_of(name), []).append((start, max(end - start, 1e-4)))
    for color, ranges in by_color.items():
        ax.broken_barh(ranges, (y - height / 2, height), facecolors=color, edgecolor="none")


def _label(ax: Axes, span: list, y: float, text: str, min_share: float) -> None:
    """Write `text` inside a span when the span is wide enough to hold it."""
    _, start, end = span
    if end - start >= min_share * ax.get_xlim()[1]:
        ax.text((start + end) / 2, y, text, ha="center", va="center", fontsize=7, color="white", clip_on=True)


def _step_note(profile: dict, step: dict) -> str:
    """The numbers under a timeline: time, calls, and how much of "forward" is operators."""
    host, ops = step["host_ms"], step["op_ms"]
    phases = " · ".join(f"{name} {ms:.2f}" for name, ms in host.items() if name != "other" or ms >= 0.01)
    busy = step["device_busy_ms"]
    device = (f"device busy {busy:.2f} ms ({busy / step['wall_ms']:.0%} of the step)" if busy is not None
              else "no device lane on a CPU: the host's operators do the arithmetic themselves")
    forward = host.get("forward", 0.0)
    inside = ops.get("forward", 0.0)
    plain = profile.get("plain_step_ms")
    # The headline is the step as the engine runs it; the profiler's own bookkeeping slows a step
    # (at batch 256 on an H200, eager: 24.8 ms plain, 65 ms profiled).
    timed = (f"step {statistics.median(plain):.2f} ms (median of {len(plain)} without the profiler; this profiled "
             f"one {step['wall_ms']:.2f} ms)" if plain else f"step {step['wall_ms']:.2f} ms on the host (profiled)")
    lines = [f"{timed}  ·  {step['launches']:,} {profile['count_label']} per step",
             device,
             f"host ms per phase: {phases}"]
    if forward:
        lines.append(f"forward: {inside:.2f} ms inside operator calls, {forward - inside:.2f} ms between them "
                     f"(Python and dispatch, {1 - inside / forward:.0%})")
    if step.get("wait_ms"):
        lines[-1] += f"  ·  host waiting for the GPU: {step['wait_ms']:.2f} ms"
    return "\n".join(lines)


def _step_end(step: dict) -> float:
    """When the step's last host or device work ended (ms from its start)."""
    return max([s[2] for key in ("phases", "host_ops", "kernels") for s in step[key]] + [step["wall_ms"]])


def draw_step_timeline(ax: Axes, profile: dict, step_index: int | None = None, xmax: float | None = None) -> None:
    """One profiled step on `ax`: lanes for the engine's phases, the decoder layers, the host's
    operator calls and (on a GPU) the device's kernels, on one axis of ms from the step's start.
    step_index: which step of the profile (default: the fastest, the one other programs on the
    machine disturbed least)."""
    index = profile["summary"]["fastest_step"] if step_index is None else step_index
    step = profile["steps"][index]
    on_gpu = profile["device_type"] == "cuda"
    ax.set_xlim(0, xmax or 1.01 * _step_end(step))
    ys = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}  # top to bottom
    phase_y, layer_y, op_y, device_y = (ys[lane] for lane in LANES)
    _bars(ax, phase_y, step["phases"], lambda name: PHASE_COLORS.get(name, PHASE_COLORS["other"]))
    for span in step["phases"]:
        _label(ax, span, phase_y, span[0], 0.04)
    _bars(ax, layer_y, [[f"{i % 2}", s, e] for i, (_, s, e) in enumerate(step["layers"])],
          lambda parity: ("#4a5568", "#a0aec0")[int(parity)])
    for span in step["layers"]:
        _label(ax, span, layer_y, span[0].replace("layer ", "L"), 0.02)
    if not step["layers"]:
        ax.text(0.01, layer_y, "none: no Python ran the layers one by one (a replayed CUDA graph, or a fused forward)",
                transform=ax.get_yaxis_transform(), va="center", fontsize=7, color="#4a5568")
    _bars(ax, op_y, step["host_ops"], lambda name: CATEGORY_COLORS[op_category(name)])
    if on_gpu:
        _bars(ax, device_y, step["kernels"], lambda name: CATEGORY_COLORS[op_category(name)])
    else:
        ax.text(0.01, device_y, "none: on a CPU the operator calls above do the work themselves",
                transform=ax.get_yaxis_transform(), va="center", fontsize=8, color="#4a5568")
    ax.set_yticks([ys[lane] for lane in LANES], LANES, fontsize=8)
    ax.set_ylim(-0.6, len(LANES) - 0.4)
    ax.set_xlabel("ms from the start of the step")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(f"{profile['variant']}: batch {profile['batch_size']}, contexts ~{profile['context']} tokens "
                 f"(step {index + 1} of {len(profile['steps'])} profiled"
                 f"{', the fastest' if index == profile['summary']['fastest_step'] else ''})", fontsize=10)
    ax.text(0, -0.32, _step_note(profile, step), transform=ax.transAxes, va="top", fontsize=8, family="monospace")


def plot_step_timeline(profiles: list[dict], shared_axis: bool = True) -> plt.Figure:
    """One panel per profile (engine setting), each its fastest step; with shared_axis the
    panels share one time axis, so a faster step is visibly shorter."""
    if not profiles:
        raise ValueError("plot_step_timeline needs at least one profile")
    xmax = 1.01 * max(_step_end(p["steps"][p["summary"]["fastest_step"]]) for p in profiles) if shared_axis else None
    fig, axes = plt.subplots(len(profiles), 1, figsize=(13, 3.9 * len(profiles)), squeeze=False)
    for ax, profile in zip(axes[:, 0], profiles):
        draw_step_timeline(ax, profile, xmax=xmax)
    first = profiles[0]
    fig.suptitle(f"One decode step of the engine, host against device\n{first['device']}, {first['dtype']}, "
                 f"{first['model']}", fontsize=11)
    shown = [p["steps"][p["summary"]["fastest_step"]] for p in profiles]
    phases = {s[0] for step in shown for s in step["phases"]}
    categories = {op_category(s[0]) for step in shown for key in ("host_ops", "kernels") for s in step[key]}
    handles = [Patch(color=c, label=f"phase: {name}") for name, c in PHASE_COLORS.items() if name in phases]
    handles += [Patch(color=c, label=name) for name, c in CATEGORY_COLORS.items() if name in categories]
    fig.tight_layout(h_pad=7)
    fig.legend(handles=handles, loc="center left", fontsize=8, frameon=False, bbox_to_anchor=(1.0, 0.5))
    return fig


def plot_step_breakdown(profiles: list[dict], title: str = "") -> plt.Figure:
    """Before and after: for each profile (engine setting), the median step's host time
    stacked by phase, and beside it the time the device was busy (GPU only)."""
    if not profiles:
        raise ValueError("plot_step_breakdown needs at least one profile")
    fig, ax = plt.subplots(figsize=(max(6.0, 2.4 * len(profiles) + 2), 4.8))
    width = 0.38
    phases = [name for name in PHASE_COLORS if any(name in p["summary"]["host_ms"] for p in profiles)]
    for i, p in enumerate(profiles):
        s = p["summary"]
        host_x = i if s["device_busy_ms"] is None else i - width / 2  # alone in its slot on a CPU
        bottom = 0.0
        for name in phases:
            ms = s["host_ms"].get(name, 0.0)
            ax.bar(host_x, ms, width, bottom=bottom, color=PHASE_COLORS[name],
                   label=f"host: {name}" if i == 0 else None)
            bottom += ms
        top = bottom
        if s["device_busy_ms"] is not None:
            ax.bar(i + width / 2, s["device_busy_ms"], width, color="#1a202c", label="device busy" if i == 0 else None)
            top = max(top, s["device_busy_ms"])
        ax.annotate(f"{s['wall_ms']:.1f} ms\n{s['launches']:,.0f} {s['count_label']}", (i, top), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    ax.set_xticks(range(len(profiles)), [p["variant"] for p in profiles])
    ax.set_ylabel("ms per decode step (median)")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.2)
    first = profiles[0]
    ax.set_title(title or f"Where a decode step's time goes\n{first['device']}, {first['dtype']}, {first['model']}, "
                 f"batch {first['batch_size']}, contexts ~{first['context']}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.grid(axis="y", alpha=0.3)
    return fig
