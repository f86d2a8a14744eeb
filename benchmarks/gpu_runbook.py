"""Every GPU number of chapters 9-12 in one command (README, "On a GPU").

    python benchmarks/gpu_runbook.py --out DIR [--parts 1,2,...] [--device cuda|cpu] [--archive FILE.tar.gz]
                                     [--wheels .whl] [--limit-scale 1.0]

Each part runs in a process of its own, in DIR (so the scripts write DIR/benchmarks/results/*.json
and DIR/figures/*.png, ready to be copied into the repository), its output in DIR/NN_name.log,
under its own time limit: a part that fails or runs out of time is killed with everything it
started, reported, and the next part runs. DIR/runbook.json sums up: the machine (GPU, driver,
CUDA, torch, Triton, transformers), each part's status, time and headline numbers. --archive
packs DIR into one .tar.gz (the GPU machine returns a few files, not folders of them).

 part               what                                                      H100 estimate  limit
 1 smoke            Qwen3-0.6B shape: the default engine (graphs, fused, Triton)       ~50 s     80 s
                    against the eager one: identical tokens in fp32; bf16 agreement
 2 gpu_tests        the suite's GPU checks (pytest -m gpu): real capture, no sync      ~40 s     70 s
 3 decode_kernel    chapter 8: the decode kernel against SDPA on dense K/V at batch    ~70 s    100 s
                    64, 128-8,192 tokens, and against copy bandwidth (no split sweep,
                    no FlexAttention, no engine run: part 5 runs the engine)
 4 step_profile     chapter 9: one decode step at batch 256, contexts ~600: eager,     ~70 s    100 s
                    graphs, graphs + fused (wall, GPU busy, launches per step)
 5 roofline         the nano workload, every engine setting; transformers on the      ~190 s    230 s
                    first 64 requests, and every setting on them too
 6 prefix_caching   chapter 11, 256 requests, caching on against off                   ~90 s    150 s
 7 serving          chapter 10 over HTTP: 1, 8, 32, 128 users, continuous against      ~90 s    120 s
                    static, with the SLO columns (ladder_gpu lengths: nano's outputs
                    would take minutes at 1 user)

FastAPI, uvicorn, httpx and openai, which the server, its client and chapter 10's test modules
import, are installed from --wheels (tools/fetch_wheels.py) before the first part that needs them
(2 or 7), into a folder only those parts' processes see.
 8 tour             minivllm tour --device cuda, 64 ladder_gpu requests               ~150 s    170 s
 9 speculation      chapter 12: a verify step of 5 tokens per sequence against a       ~40 s     90 s
                    decode step, batch 1-256, contexts ~600 (random weights: the
                    acceptance numbers need the embedded model, on the CPU)

How the estimates were made, from the shared notes' H100 measurements of chapters 1-8 (bf16,
Qwen3-0.6B shape): an eager decode step at batch 256 took 33 ms and the engine ran the nano
workload (139k output tokens) at 3,400-4,400 tok/s, ~35 s per run, which chapter 9's settings
should not slow down; transformers' generate_batch ran 583 tok/s, ~60 s for the first 64 nano
requests (36k tokens); capturing 20 batch-size buckets is ~60 forward passes, a few seconds per
engine (chapter 11 builds ~20 engines); Triton compiles a kernel variant in about a second per
dtype; the tour's early stages are launch-bound (26-110 tok/s) and run samples of 2-16
requests. Each limit is 1.2-1.7x its estimate. The two calls keep the sum of their limits under
9 minutes (500 s and 520 s), whatever happens inside them:

    python3 benchmarks/gpu_runbook.py --out /tmp/gpu-a --parts 1,2,3,4,6 --archive $OUT/gpu-a.tar.gz
    python3 benchmarks/gpu_runbook.py --out /tmp/gpu-b --parts 5,7,8 --archive $OUT/gpu-b.tar.gz
    python3 benchmarks/gpu_runbook.py --out /tmp/gpu-c --parts 9 --archive $OUT/gpu-c.tar.gz    # chapters 12-14

`--device cpu` is a dry run of the same code with the embedded model and tiny workloads (the
test suite runs it: tests/test_gpu_runbook.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_MODEL = str(ROOT / "minivllm" / "configs" / "qwen3-0.6b.json")
SERVING_MODULES = ("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")


@dataclass(frozen=True)
class Part:
    number: int
    name: str
    limit: float  # seconds, on a GPU and in the dry run alike
    gpu: Callable[[list[str]], list[str]]  # its command line on a GPU, given the model's arguments
    cpu: Callable[[list[str]], list[str]]  # the dry run's
    summarize: Callable[[Path, str], dict[str, Any]]  # headline numbers from its results in DIR
    serving_packages: bool = False  # imports FastAPI & co. (the server, or test modules that use it)

    @property
    def label(self) -> str:
        return f"{self.number} {self.name}"


def script(*path: str) -> str:
    return str(ROOT.joinpath(*path))


def results(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / "benchmarks" / "results" / f"{name}.json").read_text())


def smoke_summary(out: Path, device: str) -> dict[str, Any]:
    payload = results(out, f"gpu_smoke_{device}")
    return {dtype: f"{run['agreement']['identical_requests']}/{run['agreement']['requests']} requests identical, "
                   f"{run['agreement']['tokens_before_first_difference']:.0%} of tokens before a difference"
            for dtype, run in payload["runs"].items()}


def tests_summary(out: Path, device: str) -> dict[str, Any]:
    suite = ElementTree.parse(out / "gpu_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return counts | dict(passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"])


def kernel_summary(out: Path, device: str) -> dict[str, Any]:
    if device == "cpu":
        return {"max error vs float64": max(results(out, "08_triton_kernel_cpu_check")["errors"].values())}
    payload = results(out, "08_triton_kernel")
    goals = payload["goals"]
    return {"copy bandwidth GB/s": round(payload["copy_bandwidth_gbs"]),
            "triton / SDPA by context": dict(zip(payload["contexts"], [None if r is None else round(r, 2)
                                                                     for r in goals["ratio_vs_sdpa"]])),
            "of copy at 64 x 4,096": goals["of_copy_at_target"]}


def profile_summary(out: Path, device: str) -> dict[str, Any]:
    payload = results(out, f"09_cuda_graphs_{device}")
    return {p["variant"]: {"step ms": round(p["summary"]["wall_ms"], 2), "device busy ms": p["summary"]["device_busy_ms"],
                           p["count_label"]: p["summary"]["launches"], "same tokens": payload["same_tokens"][p["variant"]]}
            for p in payload["profiles"]}


def roofline_summary(out: Path, device: str) -> dict[str, Any]:
    return {row["name"]: {"tok/s": round(row["tokens_per_second"]), "of roofline": round(row["share_of_roofline"], 3),
                          "x transformers": row["speedup_over_transformers"], "same tokens": row["same_tokens_as_engine"]}
            for row in results(out, f"09_roofline_{device}")["rows"]}


def prefix_summary(out: Path, device: str) -> dict[str, Any]:
    headline = results(out, f"11_prefix_caching_{device}")["headline"]
    counts = headline["counts"]
    return {"prompt tokens computed on / off": f"{counts['caching on']['prompt_tokens_computed']} / "
                                                f"{counts['caching off']['prompt_tokens_computed']}",
            "TTFT p50 off / on (all at once)": round(headline["speedups"]["at_once"]["ttft_p50"], 2),
            "throughput on / off": round(headline["speedups"]["at_once"]["tokens_per_second"], 2),
            "same tokens": headline["same_tokens"]}


def serving_summary(out: Path, device: str) -> dict[str, Any]:
    runs = results(out, f"10_serving_chapter_{device}")["runs"]["concurrency"]
    return {label: {"SLO held up to": run["highest_level_meeting_slo"],
                    "TTFT p99 ms by users": {lv["concurrency"]: round(1e3 * lv["ttft"]["p99"]) if "ttft" in lv else None
                                             for lv in run["levels"]},
                    "tok/s by users": {lv["concurrency"]: round(lv["output_throughput"]) for lv in run["levels"]}}
            for label, run in runs.items()}


def tour_summary(out: Path, device: str) -> dict[str, Any]:
    payload = results(out, f"tour_{device}_{'ladder_gpu' if device == 'cuda' else 'tiny'}")
    return {row["name"]: f"{row['tokens_per_second']:,.0f} tok/s, {row['speedup']:.1f}x, {row['agrees']}"
            for row in payload["rows"]} | {"seconds": round(payload["tour_seconds"])}


def speculation_summary(out: Path, device: str) -> dict[str, Any]:
    payload = results(out, f"12_speculative_decoding_{device}")
    return {"verify (k + 1 tokens) / decode by batch": {r["batch_size"]: round(r["ratio"], 2)
                                                        for r in payload["verify_cost"]}}


PARTS = [
    Part(1, "smoke", 80, lambda m: [script("benchmarks", "gpu_smoke.py"), "--device", "cuda", *m],
         lambda m: [script("benchmarks", "gpu_smoke.py"), "--device", "cpu", *m, "--requests", "2", "--max-tokens", "4"],
         smoke_summary),
    # Collecting the suite imports every test module, chapter 10's need FastAPI & co.; a module that cannot be
    # imported is reported (errors in the summary) and the GPU checks run anyway.
    Part(2, "gpu_tests", 70, lambda m: ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", script("tests"),
                                        "--continue-on-collection-errors", "--junitxml", "gpu_tests.xml"],
         lambda m: ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", script("tests"),
                    "--continue-on-collection-errors", "--junitxml", "gpu_tests.xml"],
         tests_summary, serving_packages=True),
    Part(3, "decode_kernel", 100, lambda m: [script("chapters", "08_triton_kernel.py"), "--device", "cuda",
                                             "--e2e-requests", "0", "--skip-flex", "--skip-split-sweep"],
         lambda m: [script("chapters", "08_triton_kernel.py"), "--device", "cpu"],
         kernel_summary),
    Part(4, "step_profile", 100, lambda m: [script("chapters", "09_cuda_graphs.py"), "--device", "cuda", *m,
                                            "--batch-size", "256", "--context", "600"],
         lambda m: [script("chapters", "09_cuda_graphs.py"), "--device", "cpu", *m, "--batch-size", "4", "--context",
                    "40", "--steps", "2"],
         profile_summary),
    Part(5, "roofline", 230, lambda m: [script("benchmarks", "engine_roofline.py"), "--device", "cuda", *m,
                                        "--workload", "nano", "--peer-requests", "64"],
         lambda m: [script("benchmarks", "engine_roofline.py"), "--device", "cpu", *m, "--workload", "tiny",
                    "--requests", "4", "--peer-requests", "2"],
         roofline_summary),
    Part(6, "prefix_caching", 150, lambda m: [script("chapters", "11_prefix_caching.py"), "--device", "cuda", *m,
                                              "--requests", "256", "--repeats", "2", "--rate", "64", "--shares", "0",
                                              "0.3", "0.6", "0.9", "--sweep-repeats", "1", "--chat-repeats", "1"],
         lambda m: [script("chapters", "11_prefix_caching.py"), "--device", "cpu", *m, "--requests", "4", "--prefix",
                    "16", "--repeats", "1", "--rate", "50", "--shares", "0", "0.5", "--sweep-prompt", "32",
                    "--sweep-requests", "2", "--sweep-repeats", "1", "--conversations", "2", "--turns", "2",
                    "--chat-repeats", "1"],
         prefix_summary),
    Part(7, "serving", 120, lambda m: [script("chapters", "10_serving.py"), "--device", "cuda", *m, "--workload",
                                       "ladder_gpu", "--concurrency", "1,8,32,128", "--requests-per-level",
                                       "8,16,64,128", "--num-kv-blocks", "16384"],
         lambda m: [script("chapters", "10_serving.py"), "--device", "cpu", *m, "--workload", "tiny", "--concurrency",
                    "1,2", "--requests-per-level", "2", "--static-batch-size", "2"],
         serving_summary, serving_packages=True),
    Part(8, "tour", 170, lambda m: ["-m", "minivllm.cli", "tour", "--device", "cuda", *m, "--requests", "64",
                                    "--check", "2"],
         lambda m: ["-m", "minivllm.cli", "tour", "--device", "cpu", *m, "--workload", "tiny", "--requests", "3",
                    "--check", "1", "--stages", "naive,paged,continuous,cuda_graphs", "--no-peers"],
         tour_summary),
    Part(9, "speculation", 90, lambda m: [script("chapters", "12_speculative_decoding.py"), "--device", "cuda", *m,
                                          "--k", "4"],
         lambda m: [script("chapters", "12_speculative_decoding.py"), "--device", "cpu", *m, "--batches", "1", "2",
                    "--k", "2"],
         speculation_summary),
]


def machine(device: str) -> dict[str, Any]:
    """What the numbers were measured on: the GPU and its driver, the software, this tree."""
    import torch
    import transformers

    info: dict[str, Any] = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                                transformers=transformers.__version__, cpu_cores=os.cpu_count(), device=device)
    info["triton"] = importlib.util.find_spec("triton") and __import__("triton").__version__
    if device == "cuda":  # from nvidia-smi: this process holds no CUDA context while the parts run
        gpu = run_quietly(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        info["gpu"], info["driver"], info["gpu_memory"] = ([f.strip() for f in gpu.split(",")][:3] if gpu and gpu.count(",") >= 2
                                                           else [None, None, None])
    info["tree"] = run_quietly(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    return info


def run_quietly(command: list[str]) -> str | None:
    """A command's first line of output, or None if it cannot run here."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def serving_packages(wheels: Path, log: Path) -> tuple[str, str | None]:
    """(what happened, a folder to put on the serving part's PYTHONPATH). The server and its
    client need FastAPI, uvicorn, httpx and openai; a GPU machine without a registry gets them
    from the wheels tools/fetch_wheels.py downloaded, installed into a folder of their own."""
    missing = [name for name in SERVING_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return "installed already", None
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return f"missing {', '.join(missing)}, and no wheels in {wheels} (run tools/fetch_wheels.py where pip works)", None
    site = tempfile.mkdtemp(prefix="minivllm-serving-")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--disable-pip-version-check", "--target", site, *map(str, found)]
    with log.open("w") as output:
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=300)
    if done.returncode:
        return f"pip could not install the {len(found)} wheels of {wheels} (see {log.name})", None
    return f"installed {len(found)} wheels from {wheels}", site


def run_part(part: Part, device: str, model: list[str], out: Path, limit: float,
             extra_path: str | None) -> dict[str, Any]:
    """Run one part in its own process group under `limit` seconds; kill the group if it overruns.
    model: the --model arguments of the parts that take one; extra_path: a folder to put first
    on its PYTHONPATH (the serving packages)."""
    command = [sys.executable, *(part.gpu(model) if device == "cuda" else part.cpu(model))]
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if device == "cuda":
        env.pop("TRITON_INTERPRET", None)  # GPU parts compile their kernels
    log = out / f"{part.number:02d}_{part.name}.log"
    start = time.perf_counter()
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=out, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=limit)
            status = "ok" if returncode == 0 else f"failed (exit status {returncode})"
        except subprocess.TimeoutExpired:
            stop(process)
            status = f"timed out after {limit:.0f} s"
    seconds = time.perf_counter() - start
    row: dict[str, Any] = dict(part=part.number, name=part.name, status=status, seconds=round(seconds, 1),
                               limit=round(limit), command=command, log=log.name)
    try:
        row["summary"] = part.summarize(out, device)
    except Exception as error:  # the part failed before writing them, or wrote something else
        row["summary"] = {"results": f"not readable: {type(error).__name__}: {error}"}
    return row


def stop(process: subprocess.Popen) -> None:
    """End a part's process group (it started it: servers, workers): politely, then for good."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def parse_parts(text: str) -> list[Part]:
    by_number = {part.number: part for part in PARTS}
    try:
        numbers = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated part numbers, got {text!r}")
    unknown = [n for n in numbers if n not in by_number]
    if unknown or len(set(numbers)) != len(numbers):
        raise argparse.ArgumentTypeError(f"parts are {', '.join(map(str, by_number))}, each once; got {text!r}")
    return [by_number[n] for n in sorted(numbers)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the results, figures, logs and summary")
    parser.add_argument("--parts", type=parse_parts, default=PARTS, help="comma-separated part numbers (default: all)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a dry run with tiny sizes")
    parser.add_argument("--archive", type=Path, default=None, help="also pack DIR into this .tar.gz at the end")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels for the serving part (fetch_wheels)")
    parser.add_argument("--limit-scale", type=float, default=1.0, help="multiply every part's time limit by this")
    parser.add_argument("--model", default=None, help="the model of the parts that take one (default: the Qwen3-0.6B "
                                                      "shape on a GPU, the embedded model on a CPU)")
    args = parser.parse_args()
    if not args.limit_scale > 0:
        parser.error("--limit-scale must be positive")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here (--device cpu is the dry run)")
    source = args.model or (GPU_MODEL if args.device == "cuda" else None)
    model = ["--model", str(Path(source).resolve()) if Path(source).exists() else source] if source else []
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        parser.error(f"{out} is not empty: give the runbook a new folder")

    from rich.console import Console
    from rich.table import Table

    console = Console()
    started = time.perf_counter()
    summary: dict[str, Any] = dict(created=time.strftime("%Y-%m-%d %H:%M:%S"), command=sys.argv,
                                   machine=machine(args.device), parts=[])
    console.print(f"[bold]runbook[/] parts {', '.join(p.label for p in args.parts)} on {args.device}; "
                  f"limits sum to {sum(p.limit for p in args.parts) * args.limit_scale:.0f} s; writing to {out}")
    extra_path = None
    for part in args.parts:
        if part.serving_packages and "serving_packages" not in summary:  # once, before the first part that needs them
            summary["serving_packages"], extra_path = serving_packages(args.wheels, out / "wheels.log")
            console.print(f"serving packages: {summary['serving_packages']}")
        console.print(f"[bold]part {part.label}[/] (limit {part.limit * args.limit_scale:.0f} s) ...")
        row = run_part(part, args.device, model, out, part.limit * args.limit_scale,
                       extra_path if part.serving_packages else None)
        summary["parts"].append(row)
        summary["seconds"] = round(time.perf_counter() - started, 1)
        (out / "runbook.json").write_text(json.dumps(summary, indent=2, default=str, ensure_ascii=False) + "\n")
        colour = "green" if row["status"] == "ok" else "red"
        headline = json.dumps(row["summary"], default=str, ensure_ascii=False)
        console.print(f"  [{colour}]{row['status']}[/] in {row['seconds']:.0f} s: {headline}")
        if row["status"] != "ok":
            tail = (out / row["log"]).read_text(errors="replace").splitlines()[-15:]
            console.print("  last lines of its log:\n    " + "\n    ".join(tail), markup=False, highlight=False)

    table = Table(title=f"runbook on {summary['machine'].get('gpu', args.device)} "
                        f"({summary['seconds']:.0f} s): {out / 'runbook.json'}")
    for column in ("part", "status", "seconds", "limit", "headline"):
        table.add_column(column, overflow="fold")
    for row in summary["parts"]:
        table.add_row(f"{row['part']} {row['name']}", row["status"], f"{row['seconds']:.0f}", str(row["limit"]),
                      json.dumps(row["summary"], default=str, ensure_ascii=False))
    console.print(table)
    if args.archive:
        args.archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(args.archive, "w:gz") as archive:
            archive.add(out, arcname=out.name, filter=lambda info: None if Path(info.name).name == args.archive.name
                        else info)
        console.print(f"packed {out} into {args.archive} ({args.archive.stat().st_size / 2**20:.1f} MiB)")
    return 0 if all(row["status"] == "ok" for row in summary["parts"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
