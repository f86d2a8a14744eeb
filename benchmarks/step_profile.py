"""Profile a few steady decode steps of the engine (chapter 9), for every setting the device allows.

    python benchmarks/step_profile.py [--model SRC] [--device cpu|cuda] [--batch-size 16] [--context 200]

writes figures/09_step_timeline.png and benchmarks/results/09_step_profile_<device>.json
(the library is minivllm/course/bench/profiling.py; chapters/09_cuda_graphs.py shows the same profile
beside the chapter's other measurements).
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from minivllm.course import plots
from minivllm.course.bench.harness import add_model_arguments, console, load_for_chapter, save_results
from minivllm.course.bench.profiling import VARIANTS, profile_variants
from minivllm.machine import environment
from minivllm.course.plots.profile import plot_step_timeline


def main() -> None:
    parser = argparse.ArgumentParser(description="Profile steady decode steps of the engine (chapter 9).")
    add_model_arguments(parser)
    parser.add_argument("--batch-size", type=int, default=16, help="requests decoding side by side")
    parser.add_argument("--context", type=int, default=200, help="their contexts, in tokens (prompts within 10%%)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per variant")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="engine settings to compare (default: every one the device can run)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared machine, a second thread mostly waits)")
    parser.add_argument("--machine-note", default="", help="what else the machine was doing, saved with the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_for_chapter(args)
    with console.status("profiling"):
        profiles = profile_variants(model, args.variants, batch_size=args.batch_size, context=args.context,
                                    steps=args.steps, seed=args.seed)
    for p in profiles:
        s = p.summary()
        phases = ", ".join(f"{name} {ms:.2f}" for name, ms in s["host_ms"].items())
        busy = "—" if s["device_busy_ms"] is None else f"{s['device_busy_ms']:.2f} ms"
        console.print(f"[bold]{p.variant}[/] on {p.device}, {p.dtype}, {p.model}, batch {p.batch_size}, context "
                      f"~{p.context}: step {s['plain_step_ms']:.2f} ms (median of {len(p.plain_step_ms)} without the "
                      f"profiler; {s['wall_ms']:.2f} ms profiled); host ms: {phases}, of which waiting for the GPU "
                      f"{s['wait_ms']:.2f}; {s['launches']:,.0f} {p.count_label} per step; device busy {busy}")
    payload = dict(environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"),
                   machine_note=args.machine_note, load_average=os.getloadavg(),
                   profiles=[p.to_dict() for p in profiles])
    path = save_results(f"09_step_profile_{model.device.type}", payload)
    figure = plots.save(plot_step_timeline(payload["profiles"]), "09_step_timeline")
    console.print(f"saved {path} and {figure}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
