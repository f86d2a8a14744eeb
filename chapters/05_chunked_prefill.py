"""Chapter 5 — chunked prefill: long prompts in pieces, under a per-step token budget.

    python chapters/05_chunked_prefill.py [--model SRC] [--device cpu|cuda]

Shows a sample prefilled in small chunks (identical to chapter 2's), draws the chunk masks
(figures/05_chunk_mask.png), prints the steps of a small run where decodes and chunks share
the budget, and sweeps the chunk size on the long_prompt workload: peak attention-score memory
and time to first token (figures/05_memory_and_ttft_vs_chunk_size.png), against chapter 4's
whole-prompt prefill, with a table and benchmarks/results/05_chunked_prefill.json.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from rich.progress import track
from rich.table import Table

from minivllm import load_tokenizer
from minivllm.course import plots
from minivllm.attention.masks import chunk_mask
from minivllm.course.bench.harness import (StageResult, chapter_parser, console, load_for_chapter, results_table,
                                    save_results, useful_tokens)
from minivllm.course.bench.workloads import Workload, make_workload
from minivllm.machine import environment, synchronize
from minivllm.model import Decoder
from minivllm.course.plots.batching import plot_chunk_masks, plot_chunk_sweep
from minivllm.stages import chunked_prefill, kv_cache, ragged_batch
from minivllm.stages.common import StageStats
from minivllm.stages.ragged_batch import Step
from minivllm.course.text import encode_or_random, random_prompts, show_sample

TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Print every file under the folders named in argv.\"\"\"\n"


def score_bytes(num_heads: int, plan: list[tuple[int, int, int]]) -> int:
    """The largest attention-probability matrix of a step: heads × queries × keys, fp32.
    Segments are attended one after another, so only one exists at a time."""
    return max(4 * num_heads * n * (past + n) for _, past, n in plan)


def timed_run(
    name: str, model: Decoder, workload: Workload, steps: Iterator[Step], stats: StageStats
) -> tuple[StageResult, list[float], int]:
    """Run a stage's steps; return its result, each request's time to first token, and the
    peak score bytes (all requests arrive at time 0)."""
    outputs: list[list[int]] = [[] for _ in workload.prompts]
    first_token: dict[int, float] = {}
    peak = 0
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(model.device)
    synchronize(model.device)
    start = time.perf_counter()
    for step in steps:  # the tokens of a step are on the CPU when it is yielded: it has finished
        now = time.perf_counter() - start
        peak = max(peak, score_bytes(model.config.num_heads, step.plan))
        for request, token in step.produced:
            first_token.setdefault(request, now)
            outputs[request].append(token)
    seconds = time.perf_counter() - start
    gpu_peak = torch.cuda.max_memory_allocated(model.device) if model.device.type == "cuda" else None
    result = StageResult(name, seconds, useful_tokens(outputs, workload.output_lens), stats, gpu_peak, outputs)
    return result, [first_token[i] for i in sorted(first_token)], peak


def print_small_run(model, chunk_size: int, budget: int) -> None:
    """The plan of every step of a tiny run: decodes and prefill chunks sharing the budget."""
    prompts = random_prompts([3, 14, 9], model.config.vocab_size)
    table = Table(title=f"Three prompts (3, 14, 9 tokens), 4 outputs each, chunk_size {chunk_size}, "
                        f"max_num_batched_tokens {budget}")
    for column in ("step", "tokens", "segments: request (tokens already cached + tokens run)", "sampled"):
        table.add_column(column)
    for i, step in enumerate(chunked_prefill.steps(model, prompts, [4, 4, 4], 8, chunk_size, budget)):
        kind = {r: "decode" if past >= len(prompts[r]) else "prefill" for r, past, _ in step.plan}
        parts = [f"r{r} {kind[r]} ({past} + {n})" for r, past, n in step.plan]
        table.add_row(str(i), str(sum(n for _, _, n in step.plan)), ", ".join(parts),
                      ", ".join(f"r{r}" for r, _ in step.produced) or "—")
    console.print(table)


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--requests", type=int, default=None, help="requests in the long_prompt workload (default 8)")
    args = parser.parse_args()
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)

    prompt = encode_or_random(tokenizer, TEXT, model.config.vocab_size)
    chunked = chunked_prefill.generate(model, [prompt], 24, chunk_size=4, max_num_batched_tokens=4)[0]
    show_sample(tokenizer, prompt, chunked, title=f"{len(prompt)}-token prompt prefilled 4 tokens at a time")
    console.print("same tokens as chapter 2's whole-prompt prefill:",
                  chunked == kv_cache.generate(model, [prompt], 24)[0])

    console.print(f"saved {plots.save(plot_chunk_masks([chunk_mask(min(4, 10 - past), past) for past in range(0, 10, 4)]), '05_chunk_mask')}")
    print_small_run(model, chunk_size=4, budget=6)

    workload = make_workload("long_prompt", model.config.vocab_size, args.seed, args.requests)
    console.print(workload.describe())
    batch = len(workload.prompts)  # one group: every request is there from the start
    ragged_batch.generate(model, workload.prompts[:2], 2)  # warm-up: first calls pay for allocation
    stats = StageStats()
    runs = [timed_run("whole prompts (ch4)", model, workload,
                      ragged_batch.steps(model, workload.prompts, workload.output_lens, batch, stats), stats)]
    for c in track(args.chunk_sizes, description="chunk size sweep", console=console):
        stats = StageStats()
        # The budget equals the chunk size: decodes first, then as much prefill as fits.
        steps = chunked_prefill.steps(model, workload.prompts, workload.output_lens, batch, c, c, stats)
        runs.append(timed_run(f"chunk {c}", model, workload, steps, stats))
    for result, firsts, peak in runs:
        result.note = (f"TTFT mean {sum(firsts) / len(firsts):.2f} s, last {max(firsts):.2f} s; "
                       f"scores ≤ {peak / 2**20:.1f} MiB")
    console.print(results_table([r for r, _, _ in runs], f"Chunked prefill on {workload.describe()}",
                                baseline="whole prompts (ch4)"))

    mib = [peak / 2**20 for _, _, peak in runs]
    ttft_mean = [sum(t) / len(t) for _, t, _ in runs]
    ttft_last = [max(t) for _, t, _ in runs]
    ttft = {"mean TTFT": ttft_mean[1:], "last request's TTFT": ttft_last[1:]}
    fig = plot_chunk_sweep(args.chunk_sizes, mib[1:], ttft,
                           f"{workload.describe()}, budget = chunk size\n{environment(model)['device']}, {model.dtype}",
                           whole_prompts=(mib[0], ttft_mean[0]))  # one step prefills all: every TTFT is the same
    console.print(f"saved {plots.save(fig, '05_memory_and_ttft_vs_chunk_size')}")
    path = save_results("05_chunked_prefill", dict(
        environment=environment(model), workload=workload.describe(), budget="max_num_batched_tokens = chunk_size",
        results=[r.row() | dict(ttft_seconds=t, peak_score_bytes=p) for r, t, p in runs]))
    console.print(f"saved {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
