"""Chapter 4 — ragged batching: no padding, one flat run of tokens per step.

    python chapters/04_ragged_batching.py [--model SRC] [--device cpu|cuda]

Shows a batch of samples (identical to chapter 3's padded batch), draws the block-diagonal
causal mask next to the padded one for the same prompts (figures/04_block_diagonal_mask.png),
computes what the dense [T, T] mask would cost against T, and compares ragged with static
batching on the classroom workload (figures/04_ragged_vs_static.png), with a table and
benchmarks/results/04_ragged_batching.json.
"""
from __future__ import annotations

import torch
from rich.progress import track

from minivllm import load_tokenizer
from minivllm.course import plots
from minivllm.attention.masks import block_diagonal_mask, padded_causal_mask
from minivllm.course.bench.harness import (chapter_parser, console, format_bytes, load_for_chapter, results_table, run_stage,
                                    save_results)
from minivllm.course.bench.workloads import make_workload
from minivllm.machine import environment
from minivllm.course.plots.batching import plot_padded_vs_ragged, plot_ragged_vs_static
from minivllm.stages import kv_cache, ragged_batch, static_batch
from minivllm.course.text import demo_prompts, show_sample

MASK_LENGTHS = [5, 2, 7]  # the same prompts as chapter 3's picture


def attention_memory(num_heads: int, segment_len: int, tokens: list[int]) -> dict[str, list[float]]:
    """Bytes for one layer over a flat run of T tokens made of segments of `segment_len`: the
    dense bool mask [T, T], the dense fp32 probabilities [heads, T, T], and the per-segment
    probabilities [heads, n, n], one segment at a time (the largest that ever exists)."""
    return {
        "dense mask [T, T] (bool)": [T * T for T in tokens],
        "dense scores [heads, T, T] (fp32)": [4 * num_heads * T * T for T in tokens],
        f"per segment [heads, n, n], n = {segment_len} (fp32)": [4 * num_heads * min(T, segment_len) ** 2
                                                                  for T in tokens],
    }


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--requests", type=int, default=32, help="requests in the classroom workload")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)

    prompts = demo_prompts(tokenizer, model.config.vocab_size)
    ragged = ragged_batch.generate(model, prompts, 24, batch_size=len(prompts))
    for i, (prompt, out) in enumerate(zip(prompts, ragged)):
        show_sample(tokenizer, prompt, out, title=f"segment {i} of one flat run ({len(prompt)} prompt tokens)")
    console.print("same tokens as the padded batch (chapter 3):",
                  ragged == static_batch.generate(model, prompts, 24, batch_size=len(prompts)))

    masks = padded_causal_mask(MASK_LENGTHS), block_diagonal_mask(MASK_LENGTHS)
    console.print(f"saved {plots.save(plot_padded_vs_ragged(*masks, MASK_LENGTHS), '04_block_diagonal_mask')}")

    workload = make_workload("classroom", model.config.vocab_size, args.seed, args.requests)
    console.print(workload.describe())
    ragged_batch.generate(model, workload.prompts[:2], 2)  # warm-up: first calls pay for allocation
    runs = [("kv_cache", kv_cache.generate, {})]
    for b in args.batch_sizes:
        runs += [(f"static B={b}", static_batch.generate, dict(batch_size=b)),
                 (f"ragged B={b}", ragged_batch.generate, dict(batch_size=b))]
    results = [run_stage(name, generate, model, workload, **options)
               for name, generate, options in track(runs, description="ragged vs static", console=console)]
    for r in results:
        r.note = f"{r.stats.token_slots:,} slots computed"
    console.print(results_table(results, f"Ragged vs static batching on {workload.describe()}"))

    mean_prompt = round(sum(map(len, workload.prompts)) / len(workload.prompts))
    tokens = [2**k for k in range(6, 16)]
    memory = attention_memory(model.config.num_heads, mean_prompt, tokens)
    for name, values in memory.items():
        console.print(f"{name}: {format_bytes(values[tokens.index(4096)])} at T = 4,096", markup=False)
    fig = plot_ragged_vs_static([r.name for r in results], [r.tokens_per_second for r in results], tokens, memory,
                                f"{workload.describe()}\n{environment(model)['device']}, {model.dtype}, "
                                f"{model.config.num_heads} query heads")
    console.print(f"saved {plots.save(fig, '04_ragged_vs_static')}")
    path = save_results("04_ragged_batching", dict(
        environment=environment(model), workload=workload.describe(), results=[r.row() for r in results],
        attention_memory_bytes=dict(tokens=tokens, **memory)))
    console.print(f"saved {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
