"""Chapter 2 — KV cache: prefill once, then decode one token at a time against the cache.

    python chapters/02_kv_cache.py [--model SRC] [--device cpu|cuda]

Shows a sample (identical to chapter 1's), saves the shape of attention in decode (one query
row against the cache, figures/02_decode_attention.png), measures time per generated token
against position for naive and cached decode side by side (figures/02_time_per_token.png),
and prints what the cache costs per token for real model shapes.
"""
from __future__ import annotations

from statistics import median

import torch

import minivllm
from minivllm import load_tokenizer
from minivllm.course import plots
from minivllm.course.bench.harness import chapter_parser, console, kv_size_table, load_for_chapter, save_results
from minivllm.course.bench.timing import time_stream
from minivllm.loader import read_config
from minivllm.machine import environment
from minivllm.course.plots.lines import plot_series
from minivllm.course.plots.masks import decode_attention_picture
from minivllm.stages import kv_cache, naive
from minivllm.course.text import DEMO_PROMPT, encode_or_random, show_sample


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--tokens", type=int, default=400, help="tokens to generate for the timing plot")
    args = parser.parse_args()
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)

    prompt = encode_or_random(tokenizer, DEMO_PROMPT, model.config.vocab_size)
    cached = kv_cache.generate(model, [prompt], 40)[0]
    show_sample(tokenizer, prompt, cached)
    console.print("same tokens as naive decode:", cached == naive.generate(model, [prompt], 40)[0])

    console.print(f"saved {plots.save(decode_attention_picture(8, 8), '02_decode_attention')}")

    n = min(args.tokens, model.config.max_position_embeddings - len(prompt))
    series = {}
    for name, stage in (("naive (recompute everything)", naive), ("KV cache (one token per step)", kv_cache)):
        with console.status(f"timing {n} decode steps: {name}..."):
            series[name] = [s * 1e3 for s in time_stream(stage.stream(model, prompt, n), model.device)]
    positions = list(range(len(prompt), len(prompt) + n))
    fig, ax = plots.plt.subplots(figsize=(7, 4))
    plot_series(ax, positions, series, "position of the generated token", "ms per token",
                "Time per token: naive grows with position, cached stays flat", marker="")
    console.print(f"saved {plots.save(fig, '02_time_per_token')}")
    naive_ms, cached_ms = series.values()
    console.print(f"last 10 tokens: naive {median(naive_ms[-10:]):.1f} ms, cached {median(cached_ms[-10:]):.1f} ms per token; "
                  f"total {sum(naive_ms) / 1e3:.2f} s vs {sum(cached_ms) / 1e3:.2f} s "
                  f"({sum(naive_ms) / sum(cached_ms):.1f}× faster with the cache)")

    shapes = {f.stem: read_config(f) for f in sorted(minivllm.CONFIGS.glob("*.json"))}
    shapes["this model"] = model.config
    console.print(kv_size_table(shapes, torch.bfloat16))
    console.print("The often-quoted '16 KB per token' for Llama-2-7B is one layer; all 32 layers need 512 KiB.")
    save_results("02_kv_cache", dict(environment=environment(model), positions=positions, ms_per_token=series))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
