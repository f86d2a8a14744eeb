"""minivllm's engine against what a user would otherwise reach for, side by side in one run.

    python benchmarks/continuous_vs_transformers.py [--requests 16 32 64] [--model SRC] [--device cpu|cuda]
                                                    [--threads N] [--repeats 3]

Same model weights, same prompts, same output lengths (greedy, EOS ignored), timed in turns:
- minivllm: LLM.generate, default settings (continuous batching, paged KV cache);
- transformers static batching: `model.generate` on consecutive padded batches of 16 (left
  padding, max_new_tokens = the batch's longest output); only each request's own tokens count;
- transformers continuous batching: the manager behind `model.generate_batch`, each request
  with its own max_new_tokens (generate_batch itself takes one length for all), KV cache sized
  to hold every request (see minivllm/course/bench/peers.py).

With several request counts, each count is its own seeded workload, measured the same way: static
batching loses more as the number of requests grows, because every batch of 16 runs to its own
longest output while continuous batching runs all requests side by side.
One more, traced, minivllm run on the headline workload shows where the engine's time goes: seconds
spent in prefill steps and in decode steps of each batch size.
Writes benchmarks/results/07_vs_transformers_<device>.json and figures/07_vs_transformers.png.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from rich.table import Table

from minivllm import LLM, SamplingParams
from minivllm.course import plots
from minivllm.course.bench.harness import (chapter_parser, console, format_tokens_per_second, load_for_chapter, save_results,
                                    useful_tokens)
from minivllm.course.bench.peers import (continuous_batching_unavailable, hf_generate_batch, hf_static_generate,
                                  to_transformers, token_positions)
from minivllm.course.bench.workloads import WORKLOADS, Workload, make_workload
from minivllm.core.trace import StepRecord, Trace
from minivllm.machine import environment, synchronize
from minivllm.course.plots.lines import plot_vs_peers

OURS, STATIC, CONTINUOUS = "minivllm LLM.generate", "transformers generate (static)", "transformers generate_batch"
NOTES = {
    OURS: "continuous batching, paged KV (default settings)",
    STATIC: "left-padded batches, each run to its longest output; useful tokens only",
    CONTINUOUS: "continuous batching manager, per-request max_new_tokens, cache sized to the workload",
}
COLORS = {OURS: "#2b6cb0", STATIC: "#dd6b20", CONTINUOUS: "#38a169"}
TARGET = 3.0  # the speed-up chapter 7 aims for over both peers on the classroom workload
DECODE_SIZES = ((1, 1), (2, 4), (5, 16), (17, 64), (65, None))  # batch sizes of decode steps, grouped


def step_kind(step: StepRecord) -> str:
    if step.num_prefill_tokens:
        return "prefill (and any decodes beside it)"
    n = len(step.decode)
    low, high = next((low, high) for low, high in DECODE_SIZES if high is None or n <= high)
    if low == high:
        return f"decode, {n} request"
    return f"decode, {low}–{high} requests" if high else f"decode, {low}+ requests"


def where_time_goes(generate: Any, llm: LLM, work: Workload) -> list[dict]:
    """Run minivllm once more with a trace and add up its steps' seconds by kind of step: which
    steps an engine must speed up to go faster on this workload."""
    llm.trace = Trace()
    generate(work.prompts, work.output_lens)
    steps, llm.trace = llm.trace.steps, None
    total = sum(s.seconds for s in steps)
    kinds: dict[str, list[StepRecord]] = {}
    for step in steps:
        kinds.setdefault(step_kind(step), []).append(step)
    rows = []
    for kind, group in kinds.items():
        seconds = sum(s.seconds for s in group)
        rows.append(dict(kind=kind, steps=len(group), tokens=sum(s.num_tokens for s in group), seconds=seconds,
                         ms_per_step=1e3 * seconds / len(group), share_of_time=seconds / total))
    table = Table(title=f"where minivllm's time goes, {len(work.prompts)} requests (one traced run)")
    for column in ("kind of step", "steps", "tokens", "seconds", "ms per step", "share of time"):
        table.add_column(column, justify="left" if column == "kind of step" else "right")
    for row in rows:
        table.add_row(row["kind"], str(row["steps"]), f"{row['tokens']:,}", f"{row['seconds']:.3f}",
                      f"{row['ms_per_step']:.2f}", f"{row['share_of_time']:.0%}")
    console.print(table)
    return rows


def measure(runners: dict[str, Any], work: Workload, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Time every runner on one workload, in turns, and return one row per runner."""
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for name, run in runners.items():
            with console.status(f"{len(work.prompts)} requests, run {repeat + 1}/{args.repeats}: {name}"):
                start = time.perf_counter()
                outputs[name] = run(work.prompts, work.output_lens)
                synchronize(device)
                seconds[name].append(time.perf_counter() - start)
    needed, padded = token_positions(work.prompts, work.output_lens, args.batch_size)
    work_done = {OURS: needed, STATIC: padded, CONTINUOUS: needed}
    rows = []
    for name in runners:
        median = statistics.median(seconds[name])
        useful = useful_tokens(outputs[name], work.output_lens)
        same = sum(a == b for a, b in zip(outputs[name], outputs[OURS]))
        rows.append(dict(name=name, seconds=seconds[name], median_seconds=median, useful_tokens=useful,
                         tokens_per_second=useful / median, same_tokens_as_minivllm=f"{same}/{len(work.prompts)}",
                         token_positions_computed=work_done[name], note=NOTES[name]))
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["minivllm_speedup_over_this"] = base / row["tokens_per_second"]
        console.print(f"{len(work.prompts):4d} requests  {row['name']:32s} "
                      f"{format_tokens_per_second(row['tokens_per_second']):>8s} tok/s  "
                      f"(median of {args.repeats}: {row['median_seconds']:.2f} s)  minivllm is "
                      f"{row['minivllm_speedup_over_this']:.2f}× this  same tokens: {row['same_tokens_as_minivllm']}  "
                      f"token positions: {row['token_positions_computed']:,}")
    return rows


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--workload", default="classroom", choices=list(WORKLOADS))
    parser.add_argument("--requests", type=int, nargs="+", default=None,
                        help="one or more request counts (default: the workload's own count)")
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size of the transformers peer")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, interleaved; the median counts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_for_chapter(args)
    hf_model = to_transformers(model)
    # Every repeat runs the same prompts: a prefix cache would answer the repeats from the first
    # run's blocks, which transformers cannot do. Chapter 11 measures caching on its own.
    llm = LLM(model, enable_prefix_caching=False)

    def minivllm_generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    runners = {
        OURS: minivllm_generate,
        STATIC: lambda prompts, lens: hf_static_generate(hf_model, prompts, lens, args.batch_size),
    }
    if reason := continuous_batching_unavailable():
        console.print(f"[yellow]{CONTINUOUS} left out:[/] {reason}")
    else:
        runners[CONTINUOUS] = lambda prompts, lens: hf_generate_batch(hf_model, prompts, lens)
    own_count = WORKLOADS[args.workload]["requests"]
    counts = sorted(set(args.requests or [own_count]))
    warm = make_workload(args.workload, model.config.vocab_size, seed=args.seed, num_requests=2)
    for run in runners.values():  # warm-up: first calls pay for allocation and kernel caches
        run(warm.prompts, [4, 4])
    works = {n: make_workload(args.workload, model.config.vocab_size, seed=args.seed, num_requests=n) for n in counts}
    runs = []
    for n, work in works.items():
        console.print(f"[bold]workload[/] {work.describe()}")
        runs.append(dict(workload=dict(name=work.name, requests=n, description=work.describe(), seed=args.seed,
                                       prompt_lens=[len(p) for p in work.prompts], output_lens=work.output_lens),
                         rows=measure(runners, work, args, model.device)))
    # The headline is the workload's standard size when it was measured, else the largest count.
    headline = next((run for run in runs if run["workload"]["requests"] == own_count), runs[-1])
    steps = where_time_goes(minivllm_generate, llm, works[headline["workload"]["requests"]])

    env = environment(model)
    payload = dict(environment=env, static_batch_size=args.batch_size, target_speedup=TARGET,
                   headline_requests=headline["workload"]["requests"], runs=runs, minivllm_steps=steps,
                   created=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = save_results(f"07_vs_transformers_{model.device.type}", payload)
    subtitle = (f"{args.workload} workload, {env['model']['model_type']} {env['model']['parameters'] / 1e6:.1f}M params, "
                f"{env['device']}, {env['dtype']}, median of {args.repeats}")
    labels = {OURS: OURS, STATIC: f"transformers generate\n(static, batch {args.batch_size})",
              CONTINUOUS: "transformers\ngenerate_batch"}
    fig = plot_vs_peers(
        [dict(name=labels[r["name"]], tokens_per_second=r["tokens_per_second"], speedup=r["minivllm_speedup_over_this"])
         for r in headline["rows"]],
        f"{headline['workload']['requests']} requests", [run["workload"]["requests"] for run in runs],
        {name: [next(r for r in run["rows"] if r["name"] == name)["minivllm_speedup_over_this"] for run in runs]
         for name in runners if name != OURS},
        TARGET, [COLORS[name] for name in runners], subtitle)
    console.print(f"saved {path} and {plots.save(fig, '07_vs_transformers')}")


if __name__ == "__main__":
    main()
