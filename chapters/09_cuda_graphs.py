"""Chapter 9 — the host is the bottleneck: see where a step's time goes, then remove it.

    python chapters/09_cuda_graphs.py [--model SRC] [--device cpu|cuda] [--batch-size 16] [--context 200]

On a GPU (python chapters/09_cuda_graphs.py --device cuda --model minivllm/configs/qwen3-0.6b.json
--batch-size 256 --context 600):
- profiles one steady decode step with each of chapter 9's engine settings (eager; decode steps
  replayed from CUDA graphs; graphs plus fused token-wise kernels): host phases against device
  kernels on one time axis (figures/09_step_timeline.png) and the before/after breakdown
  (figures/09_step_breakdown.png), with kernel launches per step;
- times the host side of building a step's inputs, chapter 7's Python lists against chapter 9's
  NumPy arrays and single copy, and counts the padding rows the graphs' batch-size buckets cost
  (figures/09_lean_step.png);
- checks that every setting gives the eager engine's tokens;
- runs a workload through decode graphs and piecewise graphs (their stand-ins on a CPU) and draws
  which graphs each step replayed (figures/09_piecewise.png).
On a CPU there are no CUDA graphs and the fused kernels are GPU kernels: only the eager setting
runs, and the profile shows a CPU step (no device lane). JSON: benchmarks/results/09_cuda_graphs_<device>.json,
written under --out (default runs/, so the committed files stay as they are; --out . refreshes them).
The roofline of a whole workload is benchmarks/engine_roofline.py's.
"""
from __future__ import annotations

import random
import statistics
import time

import torch
from rich.table import Table

from minivllm import LLM, SamplingParams, load_tokenizer
from minivllm.attention.paged import PagedBatch
from minivllm.course import plots
from minivllm.course.bench.graph_paths import graph_paths
from minivllm.course.bench.harness import (
    add_output_argument,
    chapter_parser,
    console,
    enter_output_folder,
    load_for_chapter,
    save_results,
)
from minivllm.course.bench.profiling import VARIANTS, profile_variants, variants_for
from minivllm.course.plots.lines import plot_series
from minivllm.course.plots.pieces import plot_piecewise
from minivllm.course.plots.profile import plot_step_breakdown, plot_step_timeline
from minivllm.course.text import DEMO_PROMPT, encode_or_random, show_sample
from minivllm.machine import device_name, environment, synchronize
from minivllm.request.sequence import Sequence
from minivllm.worker.cuda_graphs import bucket_for, graph_batch_sizes
from minivllm.worker.prepare import build_step_arrays, device_step, to_device


def same_tokens(model, tokenizer, variants: list[str]) -> dict[str, bool]:
    """The demo prompt and a few random ones through each setting: all must give eager's tokens."""
    prompt = encode_or_random(tokenizer, DEMO_PROMPT, model.config.vocab_size)
    rng = random.Random(0)
    prompts = [prompt] + [[rng.randrange(model.config.vocab_size) for _ in range(rng.randint(5, 60))] for _ in range(7)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name in variants:
        llm = LLM(model, tokenizer=tokenizer, max_num_seqs=8, max_model_len=128, enable_prefix_caching=False,
                  **VARIANTS[name])
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    show_sample(tokenizer, prompt, outputs[variants[-1]][0], f"LLM ({variants[-1]})")
    return {name: outputs[name] == outputs["eager"] for name in variants}


def chapter7_prepare(seqs: list[Sequence], num_new: list[int], block_size: int, device: torch.device):
    """How chapter 7's runner built a step's inputs: Python lists, token by token, then one
    torch.tensor(...) per field (each a synchronous copy on a GPU)."""
    input_ids, positions, past_lens = [], [], []
    for seq, n in zip(seqs, num_new):
        start = seq.num_computed_tokens
        input_ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        past_lens.append(start)
    batch = PagedBatch.build([s.block_table for s in seqs], past_lens, num_new, block_size, device)
    return torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), batch


def chapter9_prepare(seqs: list[Sequence], num_new: list[int], block_size: int, device: torch.device):
    """Chapter 9's: NumPy arrays, one packed non-blocking copy (worker/prepare.py)."""
    arrays = build_step_arrays(seqs, num_new, block_size)
    return device_step(arrays, to_device(arrays.pack(), device))


def decode_batch(batch_size: int, context: int, block_size: int, seed: int) -> list[Sequence]:
    """batch_size sequences about to decode, contexts around `context`, blocks scattered."""
    rng = random.Random(seed)
    lengths = [max(2, int(context * rng.uniform(0.9, 1.1))) for _ in range(batch_size)]
    blocks = list(range(sum(-(-n // block_size) for n in lengths)))
    rng.shuffle(blocks)
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(str(i), [rng.randrange(1000) for _ in range(n)], SamplingParams(), max_model_len=n + 1)
        seq.num_computed_tokens = n - 1
        seq.block_table = [blocks.pop() for _ in range(-(-n // block_size))]
        seqs.append(seq)
    return seqs


def time_prepare(prepare, seqs: list[Sequence], device: torch.device, repeats: int = 30) -> float:
    """Median host microseconds of one preparation (the device finishes before each)."""
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        prepare(seqs, [1] * len(seqs), 16, device)
        times.append(time.perf_counter() - start)
    synchronize(device)
    return 1e6 * statistics.median(times)


def lean_step(device: torch.device, context: int, seed: int) -> tuple[dict, plots.Figure]:
    """Host time of building a decode step's inputs, chapter 7 vs chapter 9, and the padding
    rows of the graphs' buckets, by batch size."""
    sizes = [1, 4, 16, 64, 256]
    rows = []
    for b in sizes:
        seqs = decode_batch(b, context, 16, seed)
        rows.append(dict(batch_size=b, chapter7_us=time_prepare(chapter7_prepare, seqs, device),
                         chapter9_us=time_prepare(chapter9_prepare, seqs, device)))
    buckets = graph_batch_sizes(256)
    padding = [bucket_for(n, buckets) - n for n in range(1, 257)]
    fig, (left, right) = plots.plt.subplots(1, 2, figsize=(12, 4.3))
    plot_series(left, sizes, {"chapter 7: Python lists, a copy per field": [r["chapter7_us"] for r in rows],
                              "chapter 9: NumPy, one packed non-blocking copy": [r["chapter9_us"] for r in rows]},
                "sequences in the decode step", "host µs to build the step's inputs (median)",
                f"Building a decode step's inputs (contexts ~{context} tokens)", logy=True)
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(s) for s in sizes])
    right.bar(range(1, 257), padding, width=1.0, color="#a0aec0")
    right.set_xlabel("sequences in the decode step")
    right.set_ylabel("padding rows in the replayed graph")
    right.set_title(f"CUDA graphs: {len(buckets)} captured batch sizes ({', '.join(map(str, buckets[:6]))}, ..., 256);\n"
                    f"a step runs the smallest that fits: {sum(padding) / sum(range(1, 257)):.1%} padding "
                    f"over all sizes", fontsize=10)
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(f"A lean step, on {device_name(device)}", fontsize=11)
    fig.tight_layout()
    return dict(prepare=rows, graph_batch_sizes=buckets, padding_rows=padding), fig


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--batch-size", type=int, default=16, help="requests decoding side by side in the profile")
    parser.add_argument("--context", type=int, default=200, help="their contexts, in tokens")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per setting")
    add_output_argument(parser)
    args = parser.parse_args()
    enter_output_folder(args)
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)
    variants = variants_for(model.device)

    agree = same_tokens(model, tokenizer, variants)
    console.print("same tokens as the eager engine: " + ", ".join(f"{k} {'✓' if v else '✗'}" for k, v in agree.items()))

    with console.status(f"profiling {', '.join(variants)}"):
        profiles = [p.to_dict() for p in profile_variants(model, variants, batch_size=args.batch_size,
                                                          context=args.context, steps=args.steps, seed=args.seed)]
    table = Table(title=f"One decode step: batch {args.batch_size}, contexts ~{args.context}, "
                        f"{device_name(model.device)}, {str(model.dtype).removeprefix('torch.')}")
    for column in ("setting", "step ms", "host ms", "device busy ms", "launches / op calls", "same tokens"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for p in profiles:
        s = p["summary"]
        busy = "—" if s["device_busy_ms"] is None else f"{s['device_busy_ms']:.2f}"
        table.add_row(p["variant"], f"{s['wall_ms']:.2f}", f"{sum(s['host_ms'].values()):.2f}", busy,
                      f"{s['launches']:,.0f} {s['count_label']}", "✓" if agree[p["variant"]] else "✗")
    console.print(table)
    console.print(f"saved {plots.save(plot_step_timeline(profiles), '09_step_timeline')}")
    console.print(f"saved {plots.save(plot_step_breakdown(profiles), '09_step_breakdown')}")

    lean, fig = lean_step(model.device, max(args.context, 64), args.seed)
    prepare = Table(title="Building a decode step's inputs on the host (median µs)")
    for column in ("sequences", "chapter 7 (lists)", "chapter 9 (NumPy, one copy)", "ratio"):
        prepare.add_column(column, justify="right")
    for r in lean["prepare"]:
        prepare.add_row(str(r["batch_size"]), f"{r['chapter7_us']:,.0f}", f"{r['chapter9_us']:,.0f}",
                        f"{r['chapter7_us'] / r['chapter9_us']:.1f}×")
    console.print(prepare)
    console.print(f"saved {plots.save(fig, '09_lean_step')}")

    with console.status("which graphs each step replays"):
        paths = graph_paths(model, seed=args.seed)
    counts = {path: sum(s["path"] == path for s in paths["steps"]) for path in ("decode graph", "pieces", "eager")}
    console.print(f"{paths['workload']}: " + ", ".join(f"{n} steps {path}" for path, n in counts.items())
                  + f"; same tokens as eager {'✓' if paths['same_tokens_as_eager'] else '✗'}")
    subtitle = (f"{paths['workload']}; max_num_seqs {paths['max_num_seqs']}, max_num_batched_tokens "
                f"{paths['max_num_batched_tokens']}; {device_name(model.device)}")
    console.print(f"saved {plots.save(plot_piecewise(paths['steps'], paths['piece_sizes'], subtitle), '09_piecewise')}")

    path = save_results(f"09_cuda_graphs_{model.device.type}", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"), same_tokens=agree,
        profiles=profiles, lean_step=lean, graph_paths=paths))
    console.print(f"saved {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
