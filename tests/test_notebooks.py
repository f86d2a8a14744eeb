"""The notebooks run top to bottom, and the committed ones are clean and point where the
exercises say they do.

Executing them is marked `slow` so it is easy to leave out (`pytest -m "not slow"`); CI runs it.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from minivllm.course.exercises import EXERCISES, NOTEBOOKS

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
ALL = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def outputs_text(nb: dict) -> str:
    parts = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            parts.append(json.dumps({k: v for k, v in out.items() if k != "data"}))
            parts += [v if isinstance(v, str) else "".join(v) for k, v in out.get("data", {}).items()
                      if k.startswith("text/")]
    return "\n".join(parts)


def test_every_chapter_has_a_notebook_with_its_exercise_sections():
    """Each exercise's stub points to a section of its chapter's notebook; that section shows
    the exercise's signature and docstring (its specification) with exercises.signature."""
    for chapter, notebook in NOTEBOOKS.items():
        path = ROOT / notebook
        assert path.is_file(), f"{chapter}: missing {notebook}"
        sections: dict[str, str] = {}  # heading -> the source of the cells under it
        heading = None
        for cell in read(path)["cells"]:
            source = "".join(cell["source"])
            for line in source.splitlines() if cell["cell_type"] == "markdown" else []:
                if line.startswith("#"):
                    heading = line.lstrip("#").strip()
                    sections[heading] = ""
            if heading is not None:
                sections[heading] += source + "\n"
        for ex in EXERCISES:
            if ex.chapter == chapter:
                assert ex.section in sections, f"{notebook} has no section {ex.section!r} (the stub of {ex.label} points there)"
                assert f'signature(lookup("{ex.qualname}"))' in sections[ex.section], \
                    f"{notebook}, section {ex.section!r}: show the specification with signature(lookup({ex.qualname!r}))"


def test_engine_steps_are_drawn_as_bars():
    """A stackplot draws a line from one step's value to the next: steps become triangles."""
    for path in ALL:
        code = "\n".join("".join(c["source"]) for c in read(path)["cells"] if c["cell_type"] == "code")
        assert ".stackplot(" not in code, f"{path.name}: draw per-step values as bars (plots.scheduling.plot_step_composition)"


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_committed_notebook_is_executed_and_clean(path):
    nbformat = pytest.importorskip("nbformat")
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))  # e.g. no outputs on a markdown cell
    nb = read(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name}: commit it executed (outputs kept)"
    errors = [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{path.name}: committed with an error: {errors[0].get('ename')}: {errors[0].get('evalue')}"
    text = outputs_text(nb)
    junk = re.findall(r"(?:/tmp/|/home/|/root/|/Users/|C:\\\\Users)\S*", text)
    assert not junk, f"{path.name}: outputs hold machine-specific paths: {junk[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_notebook_runs_top_to_bottom(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    # The models are tiny: one thread is as fast as two, and much faster on a busy machine.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # As a student's kernel starts: without the interpreter this pytest process chose (conftest.INTERPRETER),
    # so a notebook that uses Triton must choose it itself, before anything imports Triton.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = sorted(p.name for p in NOTEBOOK_DIR.iterdir())
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on the first failure
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
    # Executed in memory, never written back; a notebook must not leave files next to itself either.
    assert sorted(p.name for p in NOTEBOOK_DIR.iterdir()) == before, "the notebook wrote files into notebooks/"
