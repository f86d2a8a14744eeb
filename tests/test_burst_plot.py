"""Issue 48's burst figure shows what its results file holds: one line per setting that reaches
every request, and bars at the median over rounds of each setting's p50 and p99."""
from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import pytest

from minivllm.course.plots.burst import plot_burst_ttft

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_burst_figure_draws_each_settings_distribution_and_median_percentiles():
    rounds = {"budget 2048": [[0.1, 0.2, 0.9], [0.3, 0.4, 1.1], [0.2, 0.2, 1.0]],
              "budget 2048, cap 128": [[0.1, 0.15, 0.5], [0.2, 0.3, 0.7], [0.1, 0.2, 0.6]]}
    runs = {name: [{"ttft": ttft, "ttft_p50": ttft[1], "ttft_p99": ttft[-1]} for ttft in rs]
            for name, rs in rounds.items()}
    fig = plot_burst_ttft({"runs": runs, "users": 3, "prompt_tokens": 100, "output_tokens_each": 16})
    cdf, bars = fig.axes
    lines = cdf.get_lines()
    assert [line.get_label() for line in lines] == list(rounds)
    for line, rs in zip(lines, rounds.values(), strict=True):
        assert sorted(line.get_xdata()) == pytest.approx(sorted(1e3 * t for r in rs for t in r))
        assert line.get_ydata()[-1] == 1.0  # every request has its first token at the end
    heights = [patch.get_height() for patch in bars.patches]
    assert heights == pytest.approx([200, 1000, 200, 600])  # per setting: median p50, median p99 (ms)
