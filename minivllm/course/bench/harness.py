"""The harness every chapter script uses: time a stage on a workload, the metrics of a run,
rich tables, a shared command line, and JSON results that record where the numbers came from.

Speeds are only ever *measured* here (and in the scripts that call this), never asserted in
tests: the machine may be shared and noisy, so compare stages side by side in one run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from minivllm.course.bench.workloads import Workload
from minivllm.entrypoints.cli import (
    add_model_arguments,
    dtype_argument,
    show_engine_log,
)
from minivllm.machine import device_name, synchronize
from minivllm.model import Decoder
from minivllm.stages.common import StageStats

RESULTS_DIR = Path("benchmarks/results")
console = Console()


@dataclass
class StageResult:
    name: str
    seconds: float
    useful_tokens: int
    stats: StageStats = field(default_factory=StageStats)
    peak_gpu_bytes: int | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    note: str = ""

    @property
    def tokens_per_second(self) -> float:
        return self.useful_tokens / self.seconds if self.seconds else math.inf

    def row(self) -> dict[str, Any]:
        """What goes into JSON (the outputs themselves are left out)."""
        return dict(
            name=self.name, seconds=self.seconds, useful_tokens=self.useful_tokens,
            tokens_per_second=self.tokens_per_second, padding_waste=self.stats.padding_waste,
            kv_utilisation=self.stats.kv_utilisation, peak_kv_tokens=self.stats.peak_kv_tokens,
            peak_gpu_bytes=self.peak_gpu_bytes, note=self.note,
        )


def useful_tokens(outputs: list[list[int]], output_lens: list[int]) -> int:
    """Requested tokens actually delivered: tokens past a request's own limit do not count."""
    return sum(min(len(out), n) for out, n in zip(outputs, output_lens))


def run_stage(name: str, generate: Any, model: Decoder, workload: Workload, **options: Any) -> StageResult:
    """Time one stage's `generate` over a workload (wall clock, device synchronised)."""
    device = model.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stats = StageStats()
    synchronize(device)
    start = time.perf_counter()
    outputs = generate(model, workload.prompts, workload.output_lens, stats=stats, **options)
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return StageResult(name, seconds, useful_tokens(outputs, workload.output_lens), stats, peak, outputs)


def save_results(name: str, payload: dict[str, Any], complete: bool | None = None) -> Path:
    """Write benchmarks/results/<name>.json. A benchmark that saves after every row passes
    complete=False until its last one, so a run killed half-way leaves what it finished, marked
    as such ("complete": false), instead of nothing. The file is replaced in one rename: a kill
    mid-write leaves the previous version, never half a file."""
    if complete is not None:
        payload = payload | {"complete": complete}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    partial.replace(path)
    return path


def format_tokens_per_second(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def results_table(results: list[StageResult], title: str, baseline: str | None = None) -> Table:
    """A rich table: throughput, speed-up over `baseline` (default: the first row), waste, KV use."""
    base = next((r for r in results if r.name == baseline), results[0]) if results else None
    table = Table(title=title)
    for column in ("stage", "useful tok/s", "speed-up", "padding waste", "KV utilisation", "peak KV tokens", "note"):
        table.add_column(column, justify="left" if column in ("stage", "note") else "right")
    for r in results:
        kv = r.stats.kv_utilisation
        table.add_row(
            r.name, format_tokens_per_second(r.tokens_per_second),
            f"{r.tokens_per_second / base.tokens_per_second:.1f}×" if base else "",
            f"{r.stats.padding_waste:.0%}", "—" if kv is None else f"{kv:.0%}",
            f"{r.stats.peak_kv_tokens:,}" if r.stats.peak_kv_tokens else "—", r.note,
        )
    return table


def chapter_parser(description: str) -> argparse.ArgumentParser:
    """The command line every chapter script shares."""
    parser = argparse.ArgumentParser(description=description)
    add_model_arguments(parser)
    return parser


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    """--out: where a chapter script writes its JSON and figures. The default, runs/, keeps a
    student's run from overwriting the committed files that the notebooks and the README quote;
    `--out .` (the repository) refreshes them."""
    parser.add_argument("--out", default="runs", help="write OUT/benchmarks/results/*.json and OUT/figures/*.png "
                                                      "(default: runs/; '--out .' replaces the committed files)")


def enter_output_folder(args: argparse.Namespace) -> Path:
    """Make args.out the working folder, so that everything the script writes lands under it:
    results and figures go to relative paths (RESULTS_DIR, plots.FIGURES_DIR), and so do those
    of the processes it starts (a server, `minivllm bench-serve`). A --model naming a local path
    is made absolute first. Returns the folder."""
    model = getattr(args, "model", None)
    if model is not None and Path(model).exists():
        args.model = str(Path(model).resolve())
    folder = Path(args.out).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    console.print(f"writing results and figures under {folder}")
    return folder


def load_for_chapter(args: argparse.Namespace) -> Decoder:
    """Load the model named on a chapter's command line and say what was loaded (and, from
    then on, what the engine decides for itself)."""
    from minivllm.loader import load_model

    show_engine_log()
    model = load_model(args.model, device=args.device, dtype=dtype_argument(args))
    cfg = model.config
    console.print(f"[bold]model[/] {args.model or 'embedded default'} ({cfg.model_type}, "
                  f"{cfg.num_parameters() / 1e6:.1f}M parameters) on {device_name(model.device)}, "
                  f"{str(model.dtype).removeprefix('torch.')}")
    return model


def kv_size_table(configs: dict[str, Any], dtype: torch.dtype, context: int = 4096) -> Table:
    """KV-cache bytes per token for several model shapes: 2 (K and V) x layers x kv_heads x
    head_dim x bytes per element, per layer and for the whole model."""
    element = torch.tensor([], dtype=dtype).element_size()
    table = Table(title=f"KV cache per token ({str(dtype).removeprefix('torch.')})")
    for column in ("model", "layers × kv heads × head dim", "per layer", "per token", f"{context:,}-token context"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for name, cfg in configs.items():
        per_token = cfg.kv_bytes_per_token(dtype)
        table.add_row(name, f"{cfg.num_layers} × {cfg.num_kv_heads} × {cfg.head_dim}",
                      format_bytes(2 * cfg.num_kv_heads * cfg.head_dim * element), format_bytes(per_token),
                      format_bytes(per_token * context))
    return table


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}".replace(".0 ", " ")
        n /= 1024
    raise AssertionError("unreachable")

