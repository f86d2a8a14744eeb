"""Every check this session collected, before -m, -k or xdist chose which to run: conftest.py
keeps the list under ALL_ITEMS, for the checks about the suite itself (which checks carry the
floors marker, tests/test_floors_marker.py; which files hold a chapter's checks, the classroom's
layering check in tests/test_exercises.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

ALL_ITEMS = pytest.StashKey[list[pytest.Item]]()
TESTS = Path(__file__).resolve().parent


def files_with_chapters(items: list[pytest.Item], chapters: set[str]) -> list[str] | None:
    """The test files (relative to the project root) holding a check of `chapters`, or None when
    `items` is not the whole suite (the session was given some files only): then no file may be
    left out on its word."""
    collected = {Path(str(item.path)).resolve() for item in items}
    if not set(TESTS.glob("test_*.py")) <= collected:
        return None
    holding = {Path(str(item.path)).resolve() for item in items
               if {m.name for m in item.iter_markers()} & chapters}
    return sorted(str(path.relative_to(TESTS.parent)) for path in holding)
