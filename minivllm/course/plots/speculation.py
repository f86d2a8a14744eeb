"""Pictures of speculative decoding (chapter 12): one verify step drawn token by token, acceptance
against the number of guesses, and the speed-up against batch size."""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from minivllm.course.plots.lines import doubling_axis

CONTEXT, NEWEST, ACCEPTED, REJECTED, DRAWN, FREED = "#cbd5e0", "#2b6cb0", "#38a169", "#e53e3e", "#805ad5", "#fed7d7"


@dataclass
class VerifiedRow:
    """One sequence in one verify step: its cached context length, its newest token (computed
    now), its guesses and how many the target kept, the token the target drew, and its block size.
    Texts are the tokens as the tokenizer writes them (or their ids)."""

    name: str
    context: int  # tokens whose K/V were cached before the step
    newest: str
    guesses: list[str]
    accepted: int
    drawn: str
    block_size: int


def _box(ax: plt.Axes, x: float, y: float, color: str, text: str = "", hatch: str | None = None, width: float = 1.0) -> None:
    ax.add_patch(Rectangle((x, y), width * 0.95, 0.8, facecolor=color, edgecolor="#4a5568", hatch=hatch, linewidth=0.6))
    if text:
        ax.text(x + width * 0.47, y + 0.4, text, ha="center", va="center", fontsize=7, family="monospace")


def plot_verify_step(rows: list[VerifiedRow], shown_context: int = 4) -> plt.Figure:
    """Top: each sequence's chunk — the newest token and its guesses, accepted (green) up to the
    first rejection (red), then the token the target drew (purple). Middle: the same chunks laid
    end to end, the flat run the model computes in one pass (chapter 5's ragged batch). Bottom:
    each sequence's blocks before the rollback, the ones it gives back hatched."""
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(12, 2.2 + 1.5 * len(rows)),
                                              gridspec_kw=dict(height_ratios=[len(rows), 1.2, len(rows)]))
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        top.text(-0.3, y + 0.4, row.name, ha="right", va="center", fontsize=9)
        _box(top, 0, y, CONTEXT, f"… {row.context} cached", width=shown_context)
        x = shown_context
        _box(top, x, y, NEWEST, row.newest)
        for j, guess in enumerate(row.guesses):
            kept = j < row.accepted
            _box(top, x + 1 + j, y, ACCEPTED if kept else REJECTED, guess, hatch=None if kept else "//")
        _box(top, x + 1 + len(row.guesses) + 0.3, y, DRAWN, row.drawn)
    width = shown_context + 2.5 + max(len(r.guesses) for r in rows)
    top.set_xlim(-3, width)
    top.set_ylim(-0.2, len(rows))
    top.set_title("Each sequence's verify chunk: the newest token, then its guesses (green: kept, red: rejected), "
                  "then the token the target draws", fontsize=10)
    x = 0
    for i, row in enumerate(rows):  # the flat run: every chunk end to end, one forward pass
        for j in range(1 + len(row.guesses)):
            color = NEWEST if j == 0 else ACCEPTED if j - 1 < row.accepted else REJECTED
            _box(middle, x, 0, color, str(i), hatch=None if j == 0 or j - 1 < row.accepted else "//")
            x += 1
        x += 0.4
    middle.set_xlim(-0.5, max(x, width))
    middle.set_ylim(-0.2, 1)
    middle.set_title(f"The step's ragged batch: {sum(1 + len(r.guesses) for r in rows)} tokens in one forward pass "
                     f"(number: the sequence); every one of them gets logits", fontsize=10)
    shown_blocks = 0
    for i, row in enumerate(rows):
        y = len(rows) - 1 - i
        before = -(-(row.context + 1 + len(row.guesses)) // row.block_size)
        after = -(-(row.context + 1 + row.accepted) // row.block_size)
        first = max(0, after - 3)  # the blocks up to three before the kept ones end; the rest elided
        bottom.text(-0.3, y + 0.4, row.name, ha="right", va="center", fontsize=9)
        _box(bottom, 0, y, CONTEXT, f"b0 … b{first - 1}" if first else "", width=3)
        for b in range(first, before):
            _box(bottom, 3 + b - first, y, FREED if b >= after else CONTEXT, f"b{b}", hatch="xx" if b >= after else None)
        bottom.text(3 + before - first + 0.3, y + 0.4, f"{before} → {after} blocks" + (
            f"  (the rollback gives back {before - after})" if before > after else ""), va="center", fontsize=8)
        shown_blocks = max(shown_blocks, 3 + before - first)
    bottom.set_xlim(-3, max(width, shown_blocks + 10))
    bottom.set_ylim(-0.2, len(rows))
    bottom.set_title(f"Rollback: the computed count moves back over the rejected guesses; blocks that held only "
                     f"them go back to the pool (block size {rows[0].block_size})", fontsize=10)
    for ax in (top, middle, bottom):
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_acceptance_vs_k(rows: list[dict], subtitle: str = "") -> plt.Figure:
    """rows: bench.speculation.acceptance_sweep. Left: the share of guesses kept; right: tokens
    each speculating sequence gains per target forward (1 = plain decoding), against k."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"ngram": "-", "draft": "--"}
    colors = {"repetitive": "#2b6cb0", "ordinary": "#dd6b20"}
    for method in styles:
        for kind in colors:
            points = sorted((r["k"], r) for r in rows if r["method"] == method and r["kind"] == kind)
            if not points:
                continue
            ks = [k for k, _ in points]
            label = f"{'prompt lookup' if method == 'ngram' else 'draft model'}, {kind} code"
            left.plot(ks, [r["acceptance"] for _, r in points], styles[method], color=colors[kind], marker="o", label=label)
            right.plot(ks, [r["tokens_per_forward"] for _, r in points], styles[method], color=colors[kind], marker="o",
                       label=label)
    left.set(xlabel="guesses per step (k)", ylabel="guesses kept", ylim=(0, 1.05), title="Acceptance")
    right.axhline(1, color="#a0aec0", linewidth=1)
    right.set(xlabel="guesses per step (k)", ylabel="tokens per target forward", title="Tokens per verify step")
    ks = sorted({r["k"] for r in rows})
    for ax in (left, right):
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("Speculative decoding on code" + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout()
    return fig


def plot_speedup_vs_batch(rows: list[dict], subtitle: str = "") -> plt.Figure:
    """rows: bench.speculation.batch_sweep. Speed-up of each method over plain decoding against
    the batch size; below 1 speculation costs more than it gains."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    sizes = [r["batch_size"] for r in rows]
    for method, label, style in (("ngram", "prompt lookup", "-"), ("draft", "draft model", "--")):
        ax.plot(sizes, [r[method]["speedup"] for r in rows], style, marker="o", label=label)
    ax.axhline(1, color="#e53e3e", linewidth=1, label="plain decoding")
    ax.set_xscale("log", base=2)
    doubling_axis(ax, sizes)
    ax.set(xlabel="sequences decoding side by side", ylabel="tokens/s with speculation / without",
           title="Speculation spends spare compute: it pays while a step is bound by reading weights")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if subtitle:
        fig.text(0.5, -0.02, subtitle, ha="center", fontsize=8)
    fig.tight_layout()
    return fig
