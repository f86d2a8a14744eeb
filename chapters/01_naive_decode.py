"""Chapter 1 — naive decode: recompute everything for every new token.

    python chapters/01_naive_decode.py [--model SRC] [--device cpu|cuda]

Shows a generated sample, saves the causal mask (figures/01_causal_mask.png), and measures
the time per generated token against its position (figures/01_time_per_token.png): every
step reruns the whole sequence, so each token costs more than the one before.
"""
from __future__ import annotations

from statistics import median

import torch

from minivllm import load_tokenizer
from minivllm.course import plots
from minivllm.attention.masks import causal_mask
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.course.bench.timing import time_stream
from minivllm.machine import environment
from minivllm.course.plots.lines import plot_series
from minivllm.course.plots.masks import plot_mask
from minivllm.stages import naive
from minivllm.course.text import DEMO_PROMPT, encode_or_random, show_sample


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--tokens", type=int, default=400, help="tokens to generate for the timing plot")
    args = parser.parse_args()
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)

    prompt = encode_or_random(tokenizer, DEMO_PROMPT, model.config.vocab_size)
    show_sample(tokenizer, prompt, naive.generate(model, [prompt], 40)[0])

    path = plots.save(plot_mask(causal_mask(12), "Causal mask: token i sees tokens 0..i"), "01_causal_mask")
    console.print(f"saved {path}")

    n = min(args.tokens, model.config.max_position_embeddings - len(prompt))
    with console.status(f"timing {n} naive decode steps..."):
        seconds = time_stream(naive.stream(model, prompt, n), model.device)
    positions = list(range(len(prompt), len(prompt) + n))
    fig, ax = plots.plt.subplots(figsize=(7, 4))
    plot_series(ax, positions, {"naive (recompute everything)": [s * 1e3 for s in seconds]},
                "position of the generated token", "ms per token", "Naive decode: every token costs more")
    console.print(f"saved {plots.save(fig, '01_time_per_token')}")
    first, last = median(seconds[1:11]), median(seconds[-10:])  # medians: single steps are noisy
    console.print(f"early tokens: {first * 1e3:.1f} ms each, last tokens: {last * 1e3:.1f} ms each "
                  f"({last / first:.1f}× slower by position {positions[-1]})")
    save_results("01_naive_decode", dict(environment=environment(model), positions=positions, seconds=seconds))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
