"""Chapter 15 as a picture: the engine split in two processes, and what crosses between them.

The frontend process holds everything a user touches (HTTP, the input processor, the output
processor); the core process holds the EngineCore and its busy loop. Two ZMQ sockets join them,
one each way, and every message is a msgspec struct of request/messages.py: requests and stops
go in, one StepOutputs per step comes out.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

FRONTEND, CORE, WIRE = "#2b6cb0", "#dd6b20", "#4a5568"


def _box(ax, x: float, y: float, w: float, h: float, title: str, lines: str, color: str) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", facecolor="white", edgecolor=color, lw=1.6))
    ax.text(x + w / 2, y + h - 0.09, title, ha="center", va="top", fontsize=9, weight="bold", color=color)
    ax.text(x + w / 2, y + h - 0.30, lines, ha="center", va="top", fontsize=7.5, color="#1a202c", linespacing=1.4)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = WIRE, style: str = "-|>") -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=12, color=color, lw=1.4))


def plot_core_process(step_bytes: int | None = None) -> Figure:
    """The three pieces in two processes. Left, the frontend: HTTP -> InputProcessor (text ->
    EngineCoreRequest of token ids) and OutputProcessor (token ids -> text, stop strings,
    RequestOutput) -> the user's stream. Right, the core process's busy loop: read the inbox,
    step, send. Between them, the two ZMQ sockets and the messages on each. step_bytes, if given,
    labels the StepOutputs arrow with a measured size (bytes per request per step)."""
    fig, ax = plt.subplots(figsize=(12, 5.2))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 5.2)
    ax.axis("off")

    # The two processes.
    ax.add_patch(FancyBboxPatch((0.1, 0.15), 5.4, 4.75, boxstyle="round,pad=0.04", facecolor="#ebf4ff",
                                edgecolor=FRONTEND, lw=1.2, ls="--"))
    ax.text(0.3, 4.75, "frontend process (one event loop, one GIL)", fontsize=10, weight="bold", color=FRONTEND,
            va="top")
    ax.add_patch(FancyBboxPatch((7.6, 0.15), 4.3, 4.75, boxstyle="round,pad=0.04", facecolor="#fffaf0",
                                edgecolor=CORE, lw=1.2, ls="--"))
    ax.text(7.8, 4.75, "core process (its own GIL)", fontsize=10, weight="bold", color=CORE, va="top")

    # The frontend's pieces.
    _box(ax, 0.35, 3.05, 1.55, 1.25, "HTTP", "POST /v1/completions\nSSE stream back\n/metrics", FRONTEND)
    _box(ax, 2.35, 2.75, 2.95, 1.55, "InputProcessor", "check params, tokenize\ntext -> token ids\n"
         "-> EngineCoreRequest", FRONTEND)
    _box(ax, 2.35, 0.45, 2.95, 1.85, "OutputProcessor", "token ids -> text (detokenizer)\nstop strings\n"
         "-> RequestOutput per stream\n(keeps each request's text)", FRONTEND)
    _box(ax, 0.35, 0.45, 1.55, 1.85, "streams", "one per request:\nthe user reads\nnew text here", FRONTEND)
    _arrow(ax, (1.9, 3.7), (2.35, 3.7), FRONTEND)
    _arrow(ax, (2.35, 1.35), (1.9, 1.35), FRONTEND)
    _arrow(ax, (1.1, 2.3), (1.1, 3.05), FRONTEND)

    # The core's loop.
    _box(ax, 7.9, 0.45, 3.75, 3.85, "EngineCore in a busy loop", "", CORE)
    steps = ["1. read every inbox message\n(add, abort, stop)", "2. step(): schedule -> run\n-> sample -> append",
             "3. send this step's news\n+ the gauges, one message"]
    for i, text in enumerate(steps):
        y = 3.35 - i * 1.0
        ax.text(9.45, y, text, ha="center", va="center", fontsize=8, color="#1a202c",
                bbox={"boxstyle": "round,pad=0.3", "facecolor": "#feebc8", "edgecolor": CORE, "lw": 0.8})
    for i in range(2):
        _arrow(ax, (9.45, 3.35 - i * 1.0 - 0.3), (9.45, 3.35 - (i + 1) * 1.0 + 0.3), CORE)
    ax.annotate("", xy=(11.3, 3.45), xytext=(11.3, 1.25),
                arrowprops={"arrowstyle": "-|>", "color": CORE, "lw": 1.2, "connectionstyle": "arc3,rad=-0.35"})
    ax.text(11.0, 2.35, "then\nagain", ha="center", va="center", fontsize=7, color=CORE)

    # The wire: one socket each way.
    _arrow(ax, (5.3, 3.55), (8.05, 3.55))
    ax.text(6.45, 3.68, "ZMQ PUSH -> PULL (msgspec)", ha="center", fontsize=7.5, color=WIRE, weight="bold")
    ax.text(6.45, 3.42, "AddRequest(EngineCoreRequest:\nid, prompt token ids, params)\nAbort(ids), "
            "StopSequences(ids)", ha="center", va="top", fontsize=7, color=WIRE)
    _arrow(ax, (8.05, 1.35), (5.3, 1.35))
    size = f"\n~{step_bytes} bytes per request per step" if step_bytes else ""
    ax.text(6.45, 1.48, "ZMQ PUSH -> PULL (msgspec)", ha="center", fontsize=7.5, color=WIRE, weight="bold")
    ax.text(6.45, 1.25, f"StepOutputs, one per step:\nEngineCoreOutput per request\n(new token ids, finish reason)"
            f"\n+ gauges: running, waiting, KV use{size}", ha="center", va="top", fontsize=7, color=WIRE)
    ax.text(6.45, 4.55, "what crosses: token ids,\nnever text", ha="center", fontsize=8, style="italic", color=WIRE)
    fig.tight_layout()
    return fig
