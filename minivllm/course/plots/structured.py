"""Structured outputs as pictures (chapter 13): the grammar's bitmask over the vocabulary step by
step, how often outputs fit a format with and without the mask, what free whitespace does to a
small model's JSON, and what the mask costs per step against the batch size."""
from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch

from minivllm.course.plots.lines import doubling_axis

FORBIDDEN, ALLOWED, TAKEN = "#edf2f7", "#38a169", "#e53e3e"
OUTCOME_COLORS = {"valid": "#38a169", "invalid": "#e53e3e", "cut": "#a0aec0"}
OUTCOME_LABELS = {"valid": "fits the format", "invalid": "does not fit",
                  "cut": "cut by max_tokens before the grammar ended"}


def plot_bitmask_steps(allowed: torch.Tensor, tokens: list[int], labels: list[str], title: str) -> plt.Figure:
    """allowed: [steps, V] bool, the tokens the grammar allowed before each step; tokens[s]: the
    one taken at step s, whose text is labels[s]. One row per step, the whole vocabulary across,
    the taken token marked; on the right, how many tokens were allowed."""
    steps, vocab = allowed.shape
    fig, ax = plt.subplots(figsize=(13, 0.24 * steps + 1.8))
    ax.imshow(allowed.to(torch.uint8).numpy(), aspect="auto", interpolation="nearest",
              cmap=ListedColormap([FORBIDDEN, ALLOWED]), vmin=0, vmax=1, extent=(-0.5, vocab - 0.5, steps - 0.5, -0.5))
    ax.scatter(tokens, range(steps), marker="|", s=80, linewidths=2.5, color=TAKEN, zorder=3)
    ax.set_yticks(range(steps), [f"{s}: {label!r}" for s, label in enumerate(labels)], fontsize=7)
    counts = allowed.sum(dim=1).tolist()
    for s, n in enumerate(counts):
        ax.text(vocab * 1.005, s, f"{n:,}", va="center", fontsize=7, color="#2d3748")
    ax.text(vocab * 1.005, -1.2, "allowed", fontsize=7, color="#2d3748")
    ax.set_xlim(-0.5, vocab - 0.5)
    ax.set_xlabel(f"token id: the whole vocabulary of {vocab:,} tokens")
    ax.set_ylabel("step: the token taken")
    ax.legend(handles=[Patch(facecolor=ALLOWED, label="allowed by the grammar"),
                       Patch(facecolor=FORBIDDEN, edgecolor="#cbd5e0", label="forbidden (logit set to -inf)"),
                       Patch(facecolor=TAKEN, label="the token taken (greedy: the argmax of the allowed)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.6 / (0.24 * steps + 1.8) - 0.02), ncol=3, fontsize=8,
              frameon=False)
    ax.set_title(title, fontsize=10)
    return fig


def plot_validity(counts: dict[str, dict[str, dict[str, int]]], title: str) -> plt.Figure:
    """counts: format -> {"unconstrained", "constrained"} -> {"valid", "invalid", "cut"}: one pair
    of stacked horizontal bars per format, in shares of the requests."""
    fig, ax = plt.subplots(figsize=(10, 0.9 * len(counts) + 1.6))
    y, ticks, names = 0.0, [], []
    for name, modes in counts.items():
        for mode in ("unconstrained", "constrained"):
            tally = modes[mode]
            total = sum(tally.values())
            left = 0.0
            for outcome in ("valid", "invalid", "cut"):
                share = tally[outcome] / total
                if share:
                    ax.barh(y, share, left=left, color=OUTCOME_COLORS[outcome], height=0.8, edgecolor="white")
                    if share >= 0.06:
                        ax.text(left + share / 2, y, f"{share:.0%}", ha="center", va="center", fontsize=8,
                                color="white")
                left += share
            ticks.append(y)
            names.append(f"{name}, {mode}" if mode == "unconstrained" else "… with the mask")
            y += 1
        y += 0.6
    ax.set_yticks(ticks, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    ax.set_xlabel("share of the requests")
    ax.legend(handles=[Patch(facecolor=c, label=OUTCOME_LABELS[k]) for k, c in OUTCOME_COLORS.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(counts)), ncol=3, fontsize=8, frameon=False)
    ax.set_title(title, fontsize=10)
    return fig


def plot_finish_rates(rates: dict[str, dict[str, Any]], title: str) -> plt.Figure:
    """rates: label -> {"requests", "finished", "mean_tokens", ...} (bench.structured.finish_rates):
    the share of constrained JSON that finished within max_tokens, and its mean length."""
    fig, (share_ax, tokens_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = list(rates)
    colors = ["#2b6cb0" if r["disable_any_whitespace"] else "#dd6b20" for r in rates.values()]
    shares = [r["finished"] / r["requests"] for r in rates.values()]
    share_ax.barh(labels, shares, color=colors)
    for i, (share, r) in enumerate(zip(shares, rates.values())):
        share_ax.text(share + 0.01, i, f"{share:.0%} ({r['finished']}/{r['requests']})", va="center", fontsize=8)
    share_ax.set_xlim(0, 1.25)
    share_ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}" if v <= 1 else ""))
    share_ax.set_title("finished: the grammar ended before max_tokens", fontsize=10)
    tokens_ax.barh(labels, [r["mean_tokens"] for r in rates.values()], color=colors)
    tokens_ax.set_yticks([])
    tokens_ax.set_title("mean output tokens", fontsize=10)
    for ax in (share_ax, tokens_ax):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_mask_cost(rows: list[dict[str, Any]], title: str) -> plt.Figure:
    """rows: one per batch size (bench.structured.masking_cost). Left: a decode step with and
    without every row under a grammar; right: the mask's own parts per step, and their share
    of an unconstrained step."""
    fig, (step_ax, parts_ax) = plt.subplots(1, 2, figsize=(12, 4.3))
    sizes = [r["batch_size"] for r in rows]
    step_ax.plot(sizes, [r["plain_step_ms"] for r in rows], marker="o", color="#2b6cb0", label="no constraint")
    step_ax.plot(sizes, [r["constrained_step_ms"] for r in rows], marker="o", color="#dd6b20",
                 label="every row under a JSON schema")
    step_ax.set_ylabel("decode step, median (ms)")
    step_ax.set_title("A whole decode step", fontsize=10)
    step_ax.set_ylim(bottom=0)
    step_ax.legend(fontsize=8)
    bottom = [0.0] * len(rows)
    for part, color, label in (("fill", "#805ad5", "fill the bitmask rows (xgrammar, C++)"),
                               ("apply", "#d69e2e", "apply them to the logits (PyTorch)"),
                               ("advance", "#319795", "advance the matchers by the tokens")):
        values = [r[f"{part}_us"] for r in rows]
        parts_ax.bar(range(len(rows)), values, bottom=bottom, color=color, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, (total, r) in enumerate(zip(bottom, rows)):
        parts_ax.text(i, total, f"{total / (10 * r['plain_step_ms']):.1f}%", ha="center", va="bottom", fontsize=8)
    parts_ax.set_xticks(range(len(rows)), [str(s) for s in sizes])
    parts_ax.set_ylabel("µs per step (median)")
    parts_ax.set_title("The mask's own work (labels: share of an unconstrained step)", fontsize=10)
    parts_ax.legend(fontsize=8)
    doubling_axis(step_ax, sizes)
    for ax in (step_ax, parts_ax):
        ax.set_xlabel("requests in the batch")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
