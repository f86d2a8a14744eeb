"""Chapter 6 — paged KV cache: one pool of fixed-size blocks, a block table per sequence.

    python chapters/06_paged_kv_cache.py [--model SRC] [--device cpu|cuda]

Shows a sample (identical to chapter 2's), draws the pool and the block tables at one step of
a small run (figures/06_block_table.png), runs the classroom workload through the paged stage
in a fixed KV budget, and computes on the same workload and budget how much reserved KV memory
holds real tokens and how many requests fit at once under four cache policies
(figures/06_kv_utilisation.png), against the vLLM paper's numbers.
"""
from __future__ import annotations

import time

import torch
from rich.progress import Progress
from rich.table import Table

from minivllm import load_tokenizer
from minivllm.course import plots
from minivllm.course.bench.harness import chapter_parser, console, format_bytes, load_for_chapter, save_results
from minivllm.course.bench.kv_memory import compare
from minivllm.course.bench.workloads import make_workload
from minivllm.machine import environment, synchronize
from minivllm.course.plots.paging import plot_block_tables, plot_kv_utilisation
from minivllm.stages import kv_cache, paged
from minivllm.stages.common import StageStats
from minivllm.course.text import DEMO_PROMPT, encode_or_random, random_prompts, show_sample

PAPER = "vLLM paper (arXiv 2309.06180): reservation-based systems 20.4–38.2 % of KV memory used, paging < 4 % waste"


def block_table_picture(model, seed: int) -> plots.Figure:
    """Six requests, 4-token blocks, a 32-block pool: the step where the pool is fullest."""
    prompt_lens, output_lens, block_size, num_blocks = [13, 5, 22, 9, 17, 3], [12, 20, 6, 15, 9, 18], 4, 32
    prompts = random_prompts(prompt_lens, model.config.vocab_size, seed)
    runs = list(paged.steps(model, prompts, output_lens, block_size, num_blocks, chunk_size=8,
                            max_num_batched_tokens=16))
    i, fullest = max(enumerate(runs), key=lambda s: sum(map(len, s[1].block_tables.values())))
    console.print(f"block tables after step {i} of {len(runs)} (block size {block_size}):")
    for request, table in sorted(fullest.block_tables.items()):
        console.print(f"  request {request}: {fullest.num_cached[request]:>2} tokens in blocks {table}")
    started = {request for step in runs[:i + 1] for request, _, _ in step.plan}
    waiting = len(prompts) - len(started)
    console.print(f"  {waiting} more waiting: the worst cases of those running leave too few blocks")
    return plot_block_tables(fullest.block_tables, fullest.num_cached, num_blocks, block_size,
                             f"Paged KV cache after step {i}: {len(fullest.block_tables)} requests share the pool, "
                             f"{waiting} waiting (the worst cases would not fit)")


def run_paged(model, workload, block_size: int, num_blocks: int) -> tuple[StageStats, float]:
    """The paged stage over a workload with a progress bar; returns its counters and seconds."""
    stats = StageStats()
    synchronize(model.device)
    start = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"paged stage, {num_blocks} blocks", total=workload.num_output_tokens)
        for step in paged.steps(model, workload.prompts, workload.output_lens, block_size, num_blocks, stats=stats):
            progress.advance(task, len(step.produced))
    synchronize(model.device)
    return stats, time.perf_counter() - start


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--requests", type=int, default=32, help="requests in the classroom workload")
    parser.add_argument("--kv-budget", type=int, default=4096, help="KV memory budget, in token slots")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="what a max_model_len cache reserves per request (default: the longest classroom request)")
    args = parser.parse_args()
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)

    prompt = encode_or_random(tokenizer, DEMO_PROMPT, model.config.vocab_size)
    sample = paged.generate(model, [prompt], 40, block_size=4)[0]
    show_sample(tokenizer, prompt, sample)
    console.print("same tokens as chapter 2's contiguous cache:", sample == kv_cache.generate(model, [prompt], 40)[0])

    console.print(f"saved {plots.save(block_table_picture(model, args.seed), '06_block_table')}")

    workload = make_workload("classroom", model.config.vocab_size, args.seed, args.requests)
    prompt_lens = [len(p) for p in workload.prompts]
    bytes_per_token = model.config.kv_bytes_per_token(model.dtype)
    budget_text = (f"KV budget {args.kv_budget:,} token slots ({format_bytes(args.kv_budget * bytes_per_token)} "
                   f"for this model), block size {args.block_size}, max_model_len {args.max_model_len}")
    console.print(workload.describe())
    console.print(budget_text)
    stats, seconds = run_paged(model, workload, args.block_size, args.kv_budget // args.block_size)
    console.print(f"paged stage: {workload.num_output_tokens:,} tokens in {seconds:.1f} s, KV utilisation "
                  f"{stats.kv_utilisation:.1%}, peak {stats.peak_kv_tokens:,} of {args.kv_budget:,} slots handed out")

    traces = compare(prompt_lens, workload.output_lens, args.kv_budget, args.block_size, args.max_model_len)
    table = Table(title=f"KV memory on {workload.name} ({args.requests} requests), same budget for every policy")
    for column in ("cache policy", "KV util.", "waste", "budget used", "at once", "peak", "steps", "preempt."):
        table.add_column(column, justify="left" if column == "cache policy" else "right")
    for name, t in traces.items():
        table.add_row(name, f"{t.utilisation:.1%}", f"{1 - t.utilisation:.1%}", f"{t.budget_filled:.1%}",
                      f"{t.fit_at_once:.1f}", str(t.peak_running), str(t.steps), str(t.preemptions))
    console.print(table)
    console.print("KV util.: real tokens / reserved slots, time-averaged over steps. Budget used (real tokens / "
                  "budget) and requests at once: averaged over the steps where requests queue for memory.")
    console.print(PAPER)

    fig = plot_kv_utilisation({n: t.utilisation for n, t in traces.items()},
                              {n: t.fit_at_once for n, t in traces.items()}, {n: t.running for n, t in traces.items()},
                              subtitle=f"{workload.describe()}\n{budget_text}")
    console.print(f"saved {plots.save(fig, '06_kv_utilisation')}")

    path = save_results("06_paged_kv_cache", dict(
        environment=environment(model), workload=workload.describe(), kv_budget_tokens=args.kv_budget,
        kv_budget_bytes=args.kv_budget * bytes_per_token, block_size=args.block_size, max_model_len=args.max_model_len,
        paged_stage=dict(seconds=seconds, output_tokens=workload.num_output_tokens, kv_utilisation=stats.kv_utilisation,
                         peak_kv_tokens=stats.peak_kv_tokens),
        simulated={n: dict(kv_utilisation=t.utilisation, budget_holding_tokens=t.budget_filled,
                           requests_at_once=t.fit_at_once, peak_running=t.peak_running, steps=t.steps,
                           preemptions=t.preemptions) for n, t in traces.items()},
        paper=PAPER,
    ))
    console.print(f"saved {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
