"""Every picture of the course is a function here, called by chapter scripts and notebooks.

One file per kind of picture (masks, throughput, ...); each function draws on a matplotlib
Axes or returns a Figure, and `save` writes it to figures/NAME.png.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

if matplotlib.get_backend().lower() not in ("inline", "module://matplotlib_inline.backend_inline"):
    matplotlib.use("Agg")  # scripts and CI have no display; notebooks keep their inline backend
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

FIGURES_DIR = Path("figures")


def save(fig: Figure, name: str, directory: Path | str | None = None) -> Path:
    """Write `fig` to figures/<name>.png (150 dpi, tight) and close it."""
    directory = Path(directory) if directory else FIGURES_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.png"
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path
