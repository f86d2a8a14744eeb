"""Tensor parallelism on a CPU (chapter 14): one process against N, the same requests side by side.

    python benchmarks/tensor_parallel_cpu.py [--model SRC] [--sizes 1,2] [--threads 1] [--baseline-threads 2]
                                             [--requests 8] [--prompt 32] [--output 32] [--repeats 3]

The default shape is Qwen3-0.6B with random weights (minivllm/configs/qwen3-0.6b.json: 16 query
heads, 8 KV heads), fp32, one thread per rank: a model large enough that a step's arithmetic is
worth splitting. (SmolLM2-135M's 9 attention heads cannot be split in 2; `--model
minivllm/configs/smollm2-135m.json --sizes 1,3` splits it in 3.) With --baseline-threads T, one
more row runs a single process with T threads: the same cores used by intra-op threads instead.

Per size: useful tokens/s, and a step's time on rank 0 split into compute and communication.
Writes benchmarks/results/14_tensor_parallel_cpu.json and figures/14_tensor_parallel_cpu.png.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from rich.table import Table

from minivllm.course import plots
from minivllm.course.bench.harness import add_model_arguments, console, format_bytes, load_for_chapter, save_results
from minivllm.course.bench.tensor_parallel import compare_sizes, fixed_workload, run_size
from minivllm.distributed.shard import check_shardable
from minivllm.loader import CONFIGS
from minivllm.machine import device_name, environment
from minivllm.course.plots.parallel import plot_step_split

ENGINE = dict(block_size=16, num_kv_blocks=128, enable_prefix_caching=False)  # every request fits: no preemption


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.set_defaults(model=str(CONFIGS / "qwen3-0.6b.json"), device="cpu")
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, e.g. 1,2")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    parser.add_argument("--baseline-threads", type=int, default=None,
                        help="add one process with this many threads (the same cores, threads instead of ranks)")
    parser.add_argument("--requests", type=int, default=8, help="requests decoding side by side")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens of each request")
    parser.add_argument("--output", type=int, default=32, help="output tokens of each request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per size (the median is kept)")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if min(sizes + [args.threads, args.requests, args.prompt, args.output, args.repeats]) < 1:
        parser.error("--sizes, --threads, --requests, --prompt, --output and --repeats must be at least 1")
    torch.set_num_threads(args.threads)  # each rank copies rank 0's number of threads
    model = load_for_chapter(args)
    for n in sizes:
        check_shardable(model.config, n)
    work = fixed_workload(model.config.vocab_size, args.requests, args.prompt, args.output, args.seed)
    start = time.perf_counter()
    with console.status(f"{work.name}: sizes {sizes}, {args.repeats} repeats each ..."):
        result = compare_sizes(model, sizes, work, ENGINE, args.repeats)
        rows = result["sizes"]
        if args.baseline_threads:
            torch.set_num_threads(args.baseline_threads)
            baseline = run_size(model, 1, work, ENGINE, args.repeats)
            torch.set_num_threads(args.threads)
            baseline["label"] = f"N = 1\n({args.baseline_threads} threads)"
            rows.append(baseline)
            result["same_tokens"] &= baseline["outputs_digest"] == rows[0]["outputs_digest"]
    cfg, dtype = model.config, str(model.dtype).removeprefix("torch.")
    label = f"{os.path.basename(args.model)} ({cfg.num_parameters() / 1e6:.0f}M parameters, random weights)"
    table = Table(title=f"{label}, {dtype}, {device_name(model.device)} per rank\n{work.name}; per step: median of "
                        f"{args.repeats}")
    for column in ("ranks × threads", "useful tok/s", "vs 1 process", "ms per step", "compute", "communication",
                   "bytes / step"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(f"{row['size']} × {row['threads_per_rank']}", f"{row['tokens_per_second']:,.1f}",
                      f"{row['tokens_per_second'] / rows[0]['tokens_per_second']:.2f}×",
                      f"{row['step_seconds'] * 1e3:,.1f}", f"{row['compute_seconds'] * 1e3:,.1f}",
                      f"{row['comm_seconds'] * 1e3:,.1f}", format_bytes(row["comm_bytes"]))
    console.print(table)
    console.print(f"same tokens in every run: {'✓' if result['same_tokens'] else '✗'}")
    title = (f"{label}, {dtype}, on {device_name(model.device)} per rank, gloo between processes\n"
             f"{work.name}; a step's time on rank 0, median of {args.repeats}")
    figure = plots.save(plot_step_split(rows, title), "14_tensor_parallel_cpu")
    path = save_results("14_tensor_parallel_cpu", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"), model=args.model,
        engine=ENGINE, load_average=list(os.getloadavg()), seconds=time.perf_counter() - start, **result))
    console.print(f"saved {path} and {figure}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
