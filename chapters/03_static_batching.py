"""Chapter 3 — static batching: B prompts at once, left-padded into a rectangle.

    python chapters/03_static_batching.py [--model SRC] [--device cpu|cuda]

Shows a batch of samples (each identical to chapter 2's one-at-a-time output), draws the padded
batch's mask (figures/03_padded_mask.png), and sweeps the batch size on the classroom workload:
padding waste, KV utilisation and useful throughput (figures/03_waste_vs_batch_size.png), with
a table and benchmarks/results/03_static_batching.json.
"""
from __future__ import annotations

import torch
from rich.progress import track

from minivllm import load_tokenizer
from minivllm.course import plots
from minivllm.attention.masks import padded_causal_mask
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, results_table, run_stage, save_results
from minivllm.course.bench.workloads import make_workload
from minivllm.machine import environment
from minivllm.course.plots.batching import plot_padded_mask, plot_waste_vs_batch_size
from minivllm.stages import kv_cache, static_batch
from minivllm.course.text import demo_prompts, show_sample

MASK_LENGTHS = [5, 2, 7]  # small enough to label every cell


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--requests", type=int, default=32, help="requests in the classroom workload")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    args = parser.parse_args()
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)

    prompts = demo_prompts(tokenizer, model.config.vocab_size)
    batched = static_batch.generate(model, prompts, 24, batch_size=len(prompts))
    for i, (prompt, out) in enumerate(zip(prompts, batched)):
        show_sample(tokenizer, prompt, out, title=f"row {i} of one padded batch ({len(prompt)} prompt tokens)")
    console.print("same tokens as one at a time (chapter 2):", batched == kv_cache.generate(model, prompts, 24))

    console.print(f"saved {plots.save(plot_padded_mask(padded_causal_mask(MASK_LENGTHS), MASK_LENGTHS), '03_padded_mask')}")

    workload = make_workload("classroom", model.config.vocab_size, args.seed, args.requests)
    console.print(workload.describe())
    static_batch.generate(model, workload.prompts[:2], 2)  # warm-up: first calls pay for allocation
    runs = [("kv_cache", kv_cache.generate, {})]
    runs += [(f"static B={b}", static_batch.generate, dict(batch_size=b)) for b in args.batch_sizes]
    results = [run_stage(name, generate, model, workload, **options)
               for name, generate, options in track(runs, description="batch size sweep", console=console)]
    for r in results[1:]:
        r.note = f"{r.stats.wasted_slots:,} of {r.stats.token_slots:,} slots wasted"
    console.print(results_table(results, f"Static batching on {workload.describe()}"))

    swept = results[1:]
    fig = plot_waste_vs_batch_size(args.batch_sizes, [r.stats.padding_waste for r in swept],
                                   [r.stats.kv_utilisation or 0.0 for r in swept], [r.tokens_per_second for r in swept],
                                   f"{workload.describe()}\n{environment(model)['device']}, {model.dtype}",
                                   one_at_a_time=results[0].tokens_per_second)
    console.print(f"saved {plots.save(fig, '03_waste_vs_batch_size')}")
    path = save_results("03_static_batching", dict(environment=environment(model), workload=workload.describe(),
                                                   batch_sizes=args.batch_sizes, results=[r.row() for r in results]))
    console.print(f"saved {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
