"""Print the pip requirements of CI's floor environment: the oldest transformers and Triton that
pyproject.toml allows, pinned exactly, so CI tests the floors the project declares (not copies).

Before Triton 3.7, Triton's CPU interpreter (TRITON_INTERPRET=1: chapter 8 without a GPU) needs
numpy < 2.4, which refuses the int() of a one-element array that the interpreter takes."""
from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

FLOORED = ("transformers", "triton", "xgrammar")

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
floors = {}
for line in project["dependencies"]:
    requirement = Requirement(line)
    lows = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    if requirement.name in FLOORED and lows:
        floors[requirement.name] = max(lows)
if missing := set(FLOORED) - set(floors):
    sys.exit(f"pyproject.toml declares no >= floor for {', '.join(sorted(missing))}")
pins = [f"{name}=={version}" for name, version in floors.items()]
if floors["triton"] < Version("3.7"):
    pins.append("numpy<2.4")
print(" ".join(pins))
