"""Chapter 17 as pictures: the stall a long prefill puts into a decode batch, the two
instances of disaggregated prefill with the KV blocks that cross between them, and the decode
streams' inter-token latency over time, served by one engine or by two instances.

All draw measured data: step times from course/bench/disagg.steps_beside_a_long_prompt, the
plans (KVConnectorMetadata) that record_calls kept, whose saves and loads name each block by its
prefix key, and the token arrival times of course/bench/disagg_serving.timelines.
"""
from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from minivllm.kv_transfer.base import BlockTransfer

DECODE, PREFILL = "#2b6cb0", "#dd6b20"
PRODUCER, STORAGE, CONSUMER = "#dd6b20", "#4a5568", "#2b6cb0"


def plot_prefill_stall(runs: dict[str, list[dict]], title: str = "") -> Figure:
    """One panel per run (name -> steps, each a dict of ms, prefill_tokens, decodes), one bar per
    step: its milliseconds, orange when it computed prompt tokens (labelled with how many),
    blue when it only decoded. The panels share their y axis, so stalls compare at a glance."""
    if not runs:
        raise ValueError("plot_prefill_stall needs at least one run")
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.8), sharey=True, squeeze=False)
    for ax, (name, steps) in zip(axes[0], runs.items()):
        colors = [PREFILL if s["prefill_tokens"] else DECODE for s in steps]
        bars = ax.bar(range(len(steps)), [s["ms"] for s in steps], color=colors)
        for bar, s in zip(bars, steps):
            if s["prefill_tokens"]:
                ax.annotate(f"+{s['prefill_tokens']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("engine step")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("step time (ms)")
    handles = [Rectangle((0, 0), 1, 1, color=DECODE), Rectangle((0, 0), 1, 1, color=PREFILL)]
    fig.legend(handles, ["decodes only", "decodes + prompt tokens (+N: how many)"], loc="lower center", ncol=2,
               fontsize=8, bbox_to_anchor=(0.5, -0.06))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _block(ax, x: float, y: float, text: str, color: str, filled: bool, width: float = 2.2) -> None:
    ax.add_patch(FancyBboxPatch((x, y), width, 0.55, boxstyle="round,pad=0.02", lw=1.2, edgecolor=color,
                                facecolor=color if filled else "white", alpha=0.9 if filled else 1.0))
    ax.text(x + width / 2, y + 0.275, text, ha="center", va="center", fontsize=7,
            color="white" if filled else "#1a202c", family="monospace")


def plot_disaggregation(keys: list[str], prompt_tokens: int, block_size: int, saved: list[BlockTransfer],
                        loaded: list[BlockTransfer], output_tokens: int = 0) -> Figure:
    """The producer, the shared storage and the consumer, with one request's blocks. keys: the
    prefix keys of the prompt's full blocks (kv_transfer.base.prefix_keys); saved, loaded: the
    blocks the producer's and the consumer's plans moved (KVConnectorMetadata.saves, .loads).
    One row per block of the prompt. Left, the producer's pool block: filled if it was saved.
    Middle, its file, named by the first 8 hex digits of its key. Right, the consumer's pool
    block: filled if it was loaded, else computed there. Blocks are matched by key, never by
    pool block number (each instance numbers its own). output_tokens labels what the consumer decoded."""
    num_blocks = -(-prompt_tokens // block_size)
    if len(keys) != prompt_tokens // block_size:
        raise ValueError(f"a prompt of {prompt_tokens} tokens has {prompt_tokens // block_size} full blocks of "
                         f"{block_size}, got {len(keys)} keys")
    saved_by_key = {t.key: t for t in saved}
    loaded_by_key = {t.key: t for t in loaded}
    height = 1.9 + 0.75 * num_blocks
    fig, ax = plt.subplots(figsize=(11, height))
    ax.set_xlim(0, 11)
    ax.set_ylim(0, height)
    ax.axis("off")
    for x, w, name, color in ((0.2, 3.0, "producer (kv_producer)\nprefill: max_tokens=1", PRODUCER),
                              (4.1, 2.8, "shared storage\n<layout>/<key>.safetensors", STORAGE),
                              (7.8, 3.0, "consumer (kv_consumer)\nloads, then decodes", CONSUMER)):
        ax.add_patch(FancyBboxPatch((x, 0.15), w, height - 0.35, boxstyle="round,pad=0.04", facecolor="none",
                                    edgecolor=color, lw=1.2, ls="--"))
        ax.text(x + w / 2, height - 0.3, name, ha="center", va="top", fontsize=9, weight="bold", color=color)
    for i in range(num_blocks):
        y = height - 1.25 - 0.75 * (i + 1)
        first, last = i * block_size, min((i + 1) * block_size, prompt_tokens) - 1
        tokens = f"tokens {first}-{last}"
        key = keys[i] if i < len(keys) else None  # a partly filled last block has no key
        out, into = saved_by_key.get(key), loaded_by_key.get(key)
        _block(ax, 0.6, y, f"{tokens}\nsaved: pool block {out.block}" if out else
               f"{tokens}\n{'not saved' if key else 'not full: no key'}", PRODUCER, filled=out is not None)
        if out:
            _block(ax, 4.75, y, key[:8], STORAGE, filled=True, width=1.5)
            _arrow(ax, (2.8, y + 0.275), (4.75, y + 0.275), PRODUCER)
        if into:
            _block(ax, 8.2, y, f"{tokens}\nloaded: pool block {into.block}", CONSUMER, filled=True)
            _arrow(ax, (6.25, y + 0.275), (8.2, y + 0.275), CONSUMER)
        else:
            _block(ax, 8.2, y, f"{tokens}\ncomputed here", CONSUMER, filled=False)
    ax.text(0.35, 0.3, f"{len(saved)} blocks saved", fontsize=8, color=PRODUCER)
    ax.text(7.95, 0.3, f"{len(loaded) * block_size} of {prompt_tokens} prompt tokens loaded"
            + (f",\n{output_tokens} tokens decoded" if output_tokens else ""), fontsize=8, color=CONSUMER)
    return fig


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color=color, lw=1.2))


def plot_itl_over_time(runs: dict[str, dict], title: str = "") -> Figure:
    """One panel per setup (name -> timelines: stream_token_ms, each stream's token arrival
    times, and long_arrival_ms, when each long prompt was sent; milliseconds after the start),
    sharing both axes: a dot per inter-token gap of every stream, at the time its later token
    arrived, its height the gap; a tick on top for each long prompt's arrival; dashed lines at
    the gaps' p50 and p99 (numpy's percentiles, as latency.py takes them)."""
    if not runs:
        raise ValueError("plot_itl_over_time needs at least one run")
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 3.8), sharex=True, sharey=True, squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items()):
        when = [t for times in run["stream_token_ms"] for t in times[1:]]
        gaps = [b - a for times in run["stream_token_ms"] for a, b in itertools.pairwise(times)]
        if not gaps:
            raise ValueError(f"{name}: no stream has two tokens, so there is no gap to draw")
        ax.scatter(np.asarray(when) / 1e3, gaps, s=4, color=DECODE, alpha=0.5, linewidths=0)
        for t in run["long_arrival_ms"]:
            ax.axvline(t / 1e3, color=PREFILL, alpha=0.25, lw=0.8)
        for q, style in ((50, "--"), (99, ":")):
            value = float(np.percentile(gaps, q))
            ax.axhline(value, color="#1a202c", ls=style, lw=1)
            ax.annotate(f"p{q} {value:.1f} ms", (1.0, value), xycoords=("axes fraction", "data"), ha="right",
                        va="bottom", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("time since the first request (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("gap between a stream's tokens (ms)")
    handles = [Rectangle((0, 0), 1, 1, color=DECODE), Rectangle((0, 0), 1, 1, color=PREFILL, alpha=0.4)]
    fig.legend(handles, ["a decode stream's inter-token gap", "a long prompt arrives"], loc="lower center", ncol=2,
               fontsize=8, bbox_to_anchor=(0.5, -0.06))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
