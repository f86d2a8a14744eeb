"""Download the wheels chapters 10, 13 and 15 need on a machine that cannot reach a package registry.

    python tools/fetch_wheels.py [--dest .whl] [--python-version 3.12] [--platform manylinux_2_28_x86_64 ...]

The lent GPU machines (see README, "On a GPU") have PyTorch, Triton and transformers but not
FastAPI, uvicorn, the official openai client, pyzmq, msgspec or xgrammar, and reach no registry. Run this where pip
can reach PyPI: it downloads the server's and the load generator's packages at the versions
installed here (the ones this repository's tests ran with), with every dependency pip resolves for
the target (CPython 3.12 on x86-64 Linux by default), and xgrammar (chapter 13's grammar engine)
with only the one dependency the GPU machine lacks: its others are torch, Triton, transformers and
NumPy, which that machine has and which would otherwise come along as gigabytes of wheels. All go
into the git-ignored folder .whl/. Carry that folder to the GPU machine; benchmarks/gpu_runbook.py
installs it from there before the first part that imports them (pip install --no-index --no-deps
--target ...), into a folder of its own that only those parts' processes see.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path

# The distributions chapter 10 imports (the server; its load generator; the official client its
# script and tests stream with), named as pip names them.
PACKAGES = ("fastapi", "uvicorn", "uvloop", "httptools", "pydantic", "httpx", "openai", "prometheus-client",
            "pyzmq", "msgspec",  # chapter 15: the engine core's process and its messages
            "jsonschema")  # chapter 13's checks validate what a JSON schema let through
# Downloaded without their dependencies: xgrammar needs torch, Triton, transformers and NumPy besides
# apache-tvm-ffi, and the GPU machine has those four.
WITHOUT_DEPENDENCIES = ("xgrammar", "apache-tvm-ffi")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def pinned(names: tuple[str, ...]) -> list[str]:
    """name==version for each package installed here; a bare name (pip's newest) for the others."""
    requirements = []
    for name in names:
        try:
            requirements.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            requirements.append(name)
    return requirements


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(__file__).resolve().parents[1] / ".whl")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--platform", nargs="+", default=list(PLATFORMS), help="pip platform tags to accept")
    args = parser.parse_args()
    if not args.python_version.replace(".", "").isdigit() or args.python_version.count(".") != 1:
        parser.error(f"--python-version must look like 3.12, got {args.python_version!r}")
    abi = "cp" + args.python_version.replace(".", "")
    args.dest.mkdir(parents=True, exist_ok=True)
    stale = sorted(args.dest.glob("*.whl"))
    if stale:  # two versions of one package would stop the whole install on the GPU machine
        raise SystemExit(f"{args.dest} already holds {len(stale)} wheels: empty it first")
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", args.python_version,
               "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
               *[f"--platform={tag}" for tag in args.platform], "--dest", str(args.dest)]
    for extra, names in (([], PACKAGES), (["--no-deps"], WITHOUT_DEPENDENCIES)):
        print(" ".join(command + extra + pinned(names)))
        subprocess.run(command + extra + pinned(names), check=True)
    wheels = sorted(p.name for p in args.dest.glob("*.whl"))
    size = sum(p.stat().st_size for p in args.dest.glob("*.whl"))
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB, in {args.dest}:\n  " + "\n  ".join(wheels))


if __name__ == "__main__":
    main()
