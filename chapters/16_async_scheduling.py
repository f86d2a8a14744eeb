"""Chapter 16 — the GPU never waits: a persistent batch and async scheduling.

    python chapters/16_async_scheduling.py [--batch-size 128] [--context 300] [--steps 30]
                                           [--device-ms 1,2,4,6] [--model SRC] [--device cpu|cuda]

- checks that async_scheduling=True gives the synchronous engine's tokens on the chapter's model
  (the demo prompt and a few random ones, with a stop token so that requests end early);
- on a CPU, shows the mechanism with a stand-in device (minivllm/course/bench/overlap.py): every step
  keeps it busy for a fixed time on a thread that sleeps, as a GPU computes while the host goes
  on; the engine's own host work is real. A table and figures/16_overlap.png: the synchronous
  step takes host + device, the overlapped one max(host, device);
- on a GPU (--device cuda --model minivllm/configs/qwen3-0.6b.json --batch-size 256 --context 600)
  also profiles real decode steps with and without async scheduling: step time against GPU
  busy time (the target: step <= 1.15x busy), course/bench/overlap.gpu_overlap, and the step timelines before
  and after (figures/16_step_timeline_cuda.png).
JSON: benchmarks/results/16_async_scheduling_<device>.json; it and the figures are written under --out
(default runs/, so the committed files stay as they are; --out . refreshes them). The persistent batch's host time is
benchmarks/host_step.py's (--baseline REV --results 16_host_step_cpu).
"""
from __future__ import annotations

import os
import random
import time

import torch
from rich.table import Table

from minivllm import LLM, SamplingParams, load_tokenizer
from minivllm.course import plots
from minivllm.course.bench.harness import (
    add_output_argument,
    chapter_parser,
    console,
    enter_output_folder,
    load_for_chapter,
    save_results,
)
from minivllm.course.bench.overlap import gpu_overlap, overlap_table
from minivllm.course.plots.overlap import plot_overlap
from minivllm.course.plots.profile import plot_step_timeline
from minivllm.course.text import DEMO_PROMPT, encode_or_random, show_sample
from minivllm.machine import device_name, environment


def same_tokens(model, tokenizer) -> dict:
    """The demo prompt and seven random ones, greedy, one stop token among them, on both engines."""
    prompt = encode_or_random(tokenizer, DEMO_PROMPT, model.config.vocab_size)
    rng = random.Random(0)
    prompts = [prompt] + [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(5, 60))] for _ in range(7)]
    outputs = {}
    for overlap in (False, True):
        llm = LLM(model, tokenizer=tokenizer, max_num_seqs=8, max_model_len=256, async_scheduling=overlap)
        plain = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
        stop = plain[1].outputs[0].token_ids[10]  # a token request 1 reaches: it ends early
        stopped = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop]),
                               use_tqdm=False)
        outputs[overlap] = [o.outputs[0].token_ids for o in plain + stopped]
    show_sample(tokenizer, prompt, outputs[True][0], "LLM (async_scheduling=True)")
    same = outputs[True] == outputs[False]
    console.print(f"async scheduling gives the synchronous engine's tokens: {'✓' if same else '✗'}")
    return dict(same_tokens=same, outputs=outputs[True])


def stand_in(args) -> tuple[dict, plots.Figure]:
    console.print(f"[bold]stand-in device[/]: {args.batch_size} requests decoding, contexts ~{args.context}, "
                  f"{args.steps} steps per measurement; the model never runs, the host's work is the engine's")

    def show(row):
        console.print(f"  device {row['device_ms']:.2f} ms: synchronous {row['sync_ms']:.2f} ms, "
                      f"async {row['async_ms']:.2f} ms")

    result = overlap_table(args.batch_size, args.context, args.steps, args.device_ms, progress=show)
    load = os.getloadavg()[0]
    table = Table(title=f"One decode step, {args.batch_size} requests: host work real, device a stand-in "
                        f"(medians of {args.steps} steps; load average {load:.1f})")
    for column in ("device ms", "host ms", "synchronous ms", "host + device", "async ms", "max(host, device)",
                   "speed-up"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(f"{r['device_ms']:.2f}", f"{r['host_ms']:.2f}", f"{r['sync_ms']:.2f}",
                      f"{r['host_plus_device_ms']:.2f}", f"{r['async_ms']:.2f}", f"{r['max_host_device_ms']:.2f}",
                      f"{r['speedup']:.2f}×")
    console.print(table)
    title = (f"Async scheduling on a CPU with a stand-in device: {args.batch_size} requests decoding, contexts "
             f"~{args.context}; the host's work is the engine's own, each step keeps the device busy for a fixed "
             f"time (load average {load:.1f})")
    return result | dict(load_average=load), plot_overlap(result, title)


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="requests decoding side by side")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens of each request, within 10%%")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per measurement (the median counts)")
    parser.add_argument("--device-ms", default="1,2,4,6", help="stand-in device times per step, comma-separated")
    add_output_argument(parser)
    args = parser.parse_args()
    try:
        args.device_ms = [float(x) for x in args.device_ms.split(",")]
    except ValueError:
        parser.error(f"--device-ms: comma-separated numbers, got {args.device_ms!r}")
    if any(ms <= 0 for ms in args.device_ms):
        parser.error(f"--device-ms must all be positive, got {args.device_ms}")
    for name in ("batch_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.context < 20:
        parser.error("--context must be at least 20")
    start = time.perf_counter()
    enter_output_folder(args)
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)
    facts = dict(sample=same_tokens(model, tokenizer))
    facts["stand_in"], fig = stand_in(args)
    console.print(f"saved {plots.save(fig, '16_overlap')}")
    if model.device.type == "cuda":
        with console.status(f"profiling {args.batch_size} requests on {device_name(model.device)}, with and without "
                            f"async scheduling ..."):
            facts["gpu"] = gpu_overlap(model, args.batch_size, args.context, args.steps)
        for name in ("sync", "async"):
            g = facts["gpu"][name]
            console.print(f"{name}: step {g['plain_step_ms']:.2f} ms, GPU busy {g['device_busy_ms']:.2f} ms "
                          f"({facts['gpu'][name + '_step_over_busy']:.2f}×; the target is at most 1.15×)")
        profiles = [facts["gpu"][name]["profile"] for name in ("sync", "async")]
        console.print(f"saved {plots.save(plot_step_timeline(profiles), '16_step_timeline_cuda')}")
    path = save_results(f"16_async_scheduling_{model.device.type}", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"),
        threads=torch.get_num_threads(), load_average=list(os.getloadavg()), seconds=time.perf_counter() - start,
        **facts))
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
