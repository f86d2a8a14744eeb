"""Which exercises does a chapter's checks reach? The table "Which exercises each chapter's checks
need" in docs/instructors.md, measured on the solution.

    python tools/trace_exercises.py ch15            # pytest -m ch15, then the exercises it called
    python tools/trace_exercises.py ch10 ch11       # one run per chapter

Every exercise function of the registry is wrapped when its module is imported, in this process
and in every process the checks start (servers, core processes, tensor-parallel ranks), through
tools/exercise_trace/sitecustomize.py; a wrapped function records its first call. Checks that
fail still count what they reached before failing; the script says how pytest ended.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minivllm.course.exercises import EXERCISES


def trace(chapter: str) -> tuple[dict[str, list[str]], str]:
    """({chapter: [qualnames its checks called]}, pytest's last line) for `pytest -m chapter`."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "called.txt"
        out.touch()
        env = {**os.environ, "MINIVLLM_TRACE_OUT": str(out),
               "MINIVLLM_TRACE_TARGETS": ";".join(f"{ex.module} {ex.qualname} {ex.chapter}" for ex in EXERCISES),
               "PYTHONPATH": os.pathsep.join([str(ROOT / "tools" / "exercise_trace"), str(ROOT),
                                              os.environ.get("PYTHONPATH", "")])}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", chapter, "-p", "no:randomly",
                                 "-p", "no:cacheprovider", "tests/"], check=False, cwd=ROOT, env=env,
                                 capture_output=True, text=True)
        called: dict[str, set[str]] = {}
        for line in out.read_text().splitlines():
            ch, qualname = line.split()
            called.setdefault(ch, set()).add(qualname)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return {ch: sorted(names) for ch, names in sorted(called.items())}, lines[-1] if lines else result.stderr[-500:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapters", nargs="+", help="ch01 .. ch16")
    args = parser.parse_args()
    for chapter in args.chapters:
        if not re.fullmatch(r"ch\d\d", chapter):
            parser.error(f"a chapter is ch01 .. ch16, got {chapter!r}")
        called, ending = trace(chapter)
        earlier = {ch: names for ch, names in called.items() if ch < chapter}
        later = {ch: names for ch, names in called.items() if ch > chapter}
        print(f"{chapter} (pytest: {ending})")
        print("  needs, besides its own: " + ("; ".join(f"{ch} {', '.join(n)}" for ch, n in earlier.items()) or "—"))
        print("  its own reached: " + ", ".join(called.get(chapter, [])))
        if later:
            print("  LATER chapters reached (the classroom's promise is broken): "
                  + "; ".join(f"{ch} {', '.join(n)}" for ch, n in later.items()))


if __name__ == "__main__":
    main()
