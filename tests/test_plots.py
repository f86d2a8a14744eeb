"""The course's pictures show what their titles and the chapters say: the padded batch as B
separate [L, L] matrices, engine steps as bars (never interpolated), and chapter 7's timeline
with its preemptions marked, in a run that has some."""
from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgba

import minivllm
from minivllm.attention.masks import block_diagonal_mask, padded_causal_mask
from minivllm.core.trace import DECODE, PREEMPTED, PREFILL, TIMELINE_LABELS, WAITING
from minivllm.course.plots.batching import plot_padded_vs_ragged
from minivllm.course.plots.scheduling import plot_step_composition, plot_timeline

matplotlib.use("Agg")
CHAPTER_7 = Path(__file__).parents[1] / "chapters" / "07_continuous_batching.py"


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def drawn_cells(ax) -> int:
    """Cells of the axes' image that are not blank (white)."""
    image = ax.images[0]
    rgba = image.to_rgba(image.get_array(), bytes=True)  # [rows, cols, 4] in 0..255
    return int((rgba[..., :3] != 255).any(-1).sum())


def test_padded_panel_draws_one_matrix_per_row_and_counts_its_cells():
    lengths = [5, 2, 7]
    B, L, T = len(lengths), max(lengths), sum(lengths)
    fig = plot_padded_vs_ragged(padded_causal_mask(lengths), block_diagonal_mask(lengths), lengths)
    padded, ragged = fig.axes[:2]
    assert drawn_cells(padded) == B * L * L, "the padded panel should draw B squares of L x L scores, nothing between"
    assert f"{B * L * L} scores" in padded.get_title()
    assert drawn_cells(ragged) == T * T and f"{T * T} scores as one mask" in ragged.get_title()


def test_step_composition_draws_one_bar_per_step():
    prefill, decode = [64, 0, 12, 0], [0, 3, 3, 2]
    fig = plot_step_composition(prefill, decode, budget=64, title="steps")
    ax = fig.axes[0]
    assert not any(isinstance(c, PolyCollection) for c in ax.collections), "a stackplot interpolates between steps"
    decode_bars, prefill_bars = ax.containers
    assert [b.get_height() for b in decode_bars] == decode and [b.get_height() for b in prefill_bars] == prefill
    assert [b.get_y() for b in prefill_bars] == decode  # prefill stacked on the step's decodes


@pytest.mark.floors
def test_timeline_marks_each_preemption():
    grid = [[PREFILL, DECODE, PREEMPTED, WAITING, PREFILL, DECODE],
            [WAITING, PREFILL, DECODE, DECODE, PREEMPTED, WAITING]]
    fig = plot_timeline(["0", "1"], grid, TIMELINE_LABELS, "two requests", marked=PREEMPTED)
    ax = fig.axes[0]
    markers = [line for line in ax.lines if line.get_marker() not in (None, "None", "")]
    assert len(markers) == 1 and sorted(zip(markers[0].get_xdata(), markers[0].get_ydata())) == [(2, 0), (4, 1)]
    assert to_rgba(markers[0].get_color()) != to_rgba("white")
    assert any("preempted (2×)" in t.get_text() for t in ax.get_legend().get_texts())


@pytest.mark.floors
def test_chapter_7_timeline_run_has_preemptions(monkeypatch, tmp_path):
    """The settings of chapter 7's traced run make the scheduler preempt (the chapter's hardest
    idea must be in its picture), whatever the machine's speed: arrivals are counted in steps."""
    chapter = runpy.run_path(str(CHAPTER_7), run_name="chapter_7")
    saved = []
    monkeypatch.setattr(chapter["plots"], "save", lambda fig, name: saved.append(name) or tmp_path / name)
    facts = chapter["timeline"](minivllm.load_model(device="cpu"), SimpleNamespace(seed=0))
    assert facts["preemptions"] > 0 and facts["recomputed_tokens"] > 0, facts
    assert saved == ["07_timeline", "07_step_composition"]


@pytest.mark.floors
def test_disaggregation_picture_matches_blocks_by_key():
    """Chapter 17: a block crosses (an arrow producer -> file -> consumer) exactly when the producer
    saved its key and the consumer loaded it, whatever pool block each instance gave it."""
    from matplotlib.patches import FancyArrowPatch

    from minivllm.course.plots.disagg import plot_disaggregation
    from minivllm.kv_transfer.base import BlockTransfer

    keys = ["a" * 64, "b" * 64, "c" * 64]  # a prompt of 52 tokens: 3 full blocks of 16 and 4 tokens
    saved = [BlockTransfer(5 + i, key) for i, key in enumerate(keys)]
    # The consumer computes block 2 itself; its plans may list blocks in any order.
    loaded = [BlockTransfer(1, keys[1]), BlockTransfer(0, keys[0])]
    fig = plot_disaggregation(keys, 52, 16, saved, loaded)
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert [t for t in texts if t in ("aaaaaaaa", "bbbbbbbb", "cccccccc")] == ["aaaaaaaa", "bbbbbbbb", "cccccccc"]
    assert [t for t in texts if "saved: pool block" in t] == [f"tokens {16 * i}-{16 * i + 15}\nsaved: pool block {5 + i}"
                                                             for i in range(3)]
    assert [t for t in texts if "loaded: pool block" in t] == ["tokens 0-15\nloaded: pool block 0",
                                                              "tokens 16-31\nloaded: pool block 1"]
    assert texts.count("tokens 32-47\ncomputed here") == 1 and texts.count("tokens 48-51\ncomputed here") == 1
    assert sum(isinstance(p, FancyArrowPatch) for p in ax.patches) == len(saved) + len(loaded)
    with pytest.raises(ValueError, match="3 full blocks"):
        plot_disaggregation(keys[:2], 52, 16, saved, loaded)


@pytest.mark.floors
def test_prefill_stall_draws_one_bar_per_step_coloured_by_prompt_tokens():
    from minivllm.course.plots.disagg import DECODE, PREFILL, plot_prefill_stall

    steps = [dict(ms=10.0, prefill_tokens=0, decodes=8), dict(ms=90.0, prefill_tokens=480, decodes=8),
             dict(ms=12.0, prefill_tokens=0, decodes=9)]
    fig = plot_prefill_stall({"one engine": steps, "consumer": steps[:1]})
    one, consumer = fig.axes[:2]
    assert [b.get_height() for b in one.patches] == [10.0, 90.0, 12.0] and len(consumer.patches) == 1
    assert [to_rgba(b.get_facecolor()) for b in one.patches] == [to_rgba(c) for c in (DECODE, PREFILL, DECODE)]
    assert [t.get_text() for t in one.texts] == ["+480"]
    assert one.get_ylim() == consumer.get_ylim()  # shared: stalls compare across panels
