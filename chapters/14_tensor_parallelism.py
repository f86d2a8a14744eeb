"""Chapter 14 — tensor parallelism: one model split across several processes, on torch.distributed.

    python chapters/14_tensor_parallelism.py [--model SRC] [--device cpu|cuda] [--sizes 1,2,4] [--threads 1]
                                             [--requests 16] [--prompt 32] [--output 32] [--repeats 1]
                                             [--cost-only]

- a sample: the same prompts at tensor_parallel_size 1 and 2, and the same tokens;
- one layer's weights as each of 2 ranks holds them, found in the real shards, with the two
  all-reduces marked (figures/14_sharded_layer.png);
- a step's time split into compute and communication at each size (gloo on a CPU), the same
  requests side by side in one run (figures/14_step_split.png);
- the cost model: all-reduce bytes per token per layer against NVLink, PCIe and Ethernet, and
  where tensor parallelism pays for 8 GPUs and for 2 nodes, on paper (figures/14_tp_cost.png);
- copies or splits on paper: 8 whole copies against an 8-way split and one GPU, tokens per second
  and ms per step over the batch (figures/14_copies_or_splits_cost.png).
JSON: benchmarks/results/14_tensor_parallelism_<device>.json; with --cost-only, only the two cost
models (no model is loaded, a second or two): benchmarks/results/14_cost_model.json. The CPU benchmark on a larger shape
is benchmarks/tensor_parallel_cpu.py.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch
from rich.table import Table

from minivllm import LLM, SamplingParams, load_tokenizer
from minivllm.course import plots
from minivllm.course.bench.harness import chapter_parser, console, format_bytes, load_for_chapter, save_results
from minivllm.course.bench.tensor_parallel import compare_sizes, fixed_workload, shard_layout
from minivllm.course.bench.tp_cost import (GPU, LINKS, allreduce_bytes_per_token_per_layer, copies_or_splits, model_shapes,
                                    speedup_grid)
from minivllm.distributed.shard import check_shardable
from minivllm.machine import device_name, environment
from minivllm.course.plots.parallel import plot_copies_or_splits_cost, plot_sharded_layer, plot_step_split, plot_tp_cost
from minivllm.course.text import DEMO_PROMPTS, encode_or_random, show_sample

ENGINE = dict(block_size=16, num_kv_blocks=256, enable_prefix_caching=False)  # every request fits: no preemption
BATCHES = [1, 4, 16, 64, 256, 1024]
CONTEXT = 1024  # tokens each sequence holds in the cost model's decode steps
CURVE_BATCHES = [2 ** k for k in range(11)]  # 1 ... 1,024: the copies-or-splits curves
TABLE_BATCHES = [1, 64, 256]


def splittable(model, sizes: list[int]) -> list[int]:
    """The sizes this model can be split into (the others are said and left out)."""
    kept = []
    for n in sizes:
        try:
            check_shardable(model.config, n)
            kept.append(n)
        except ValueError as error:
            console.print(f"[yellow]leaving out tensor_parallel_size={n}: {error}[/]")
    return kept


def sample(model, tokenizer, new_tokens: int) -> dict:
    """The demo prompts, greedy, on one process and on two: the same tokens."""
    prompts = [encode_or_random(tokenizer, p, model.config.vocab_size, seed=i) for i, p in enumerate(DEMO_PROMPTS)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = {}
    for n in (1, 2):
        llm = LLM(model, tokenizer=tokenizer, tensor_parallel_size=n, **ENGINE)
        outputs[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if n > 1:
            llm.engine.core.runner.shutdown()
    show_sample(tokenizer, prompts[0], outputs[2][0], "tensor_parallel_size=2")
    same = outputs[1] == outputs[2]
    console.print(f"same tokens on 1 and 2 processes: {'✓' if same else '✗'}")
    return dict(prompts=prompts, outputs={str(n): o for n, o in outputs.items()}, same_tokens=same)


def layer_picture(model, label: str) -> tuple[dict, plots.Figure]:
    layout = shard_layout(model, 2)
    cfg = model.config
    title = (f"Layer 0 of {label} ({cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
             f"MLP width {cfg.intermediate_size}) split across 2 ranks, as the shards hold it\n"
             f"each matrix drawn as A = W^T: input features down, output features across, all at one scale")
    return dict(world_size=2, layout=layout), plot_sharded_layer(layout, 2, title)


def step_split(model, args, label: str) -> tuple[dict, plots.Figure]:
    work = fixed_workload(model.config.vocab_size, args.requests, args.prompt, args.output, args.seed)
    console.print(f"[bold]workload[/] {work.name}; sizes {args.sizes}, {torch.get_num_threads()} thread(s) "
                  f"per rank")
    with console.status("running each size on a fresh engine ..."):
        result = compare_sizes(model, args.sizes, work, ENGINE, args.repeats)
    cfg = model.config
    table = Table(title=f"{work.name}\n{label} on {device_name(model.device)}, "
                        f"{str(model.dtype).removeprefix('torch.')}; per step: median of {args.repeats}")
    for column in ("ranks", "useful tok/s", "ms per step", "compute", "communication", "collectives / step",
                   "bytes / step"):
        table.add_column(column, justify="right")
    for row in result["sizes"]:
        table.add_row(str(row["size"]), f"{row['tokens_per_second']:,.1f}", f"{row['step_seconds'] * 1e3:.1f}",
                      f"{row['compute_seconds'] * 1e3:.1f}", f"{row['comm_seconds'] * 1e3:.1f}",
                      f"{row['comm_calls']:.0f}", format_bytes(row["comm_bytes"]))
    console.print(table)
    console.print(f"collectives per forward pass: {2 * cfg.num_layers} all-reduces in the layers + 1 for the "
                  f"embedding, and 1 gather of the logits; same tokens at every size: "
                  f"{'✓' if result['same_tokens'] else '✗'}")
    title = (f"{label}, {str(model.dtype).removeprefix('torch.')}, on {device_name(model.device)} per rank, "
             f"gloo between processes\n{work.name}; a step's time on rank 0, median of {args.repeats}")
    return result, plot_step_split(result["sizes"], title)


def cost_model() -> tuple[dict, plots.Figure]:
    shapes = model_shapes()
    grids = [speedup_grid(shapes, BATCHES, link, CONTEXT) for link in LINKS]
    table = Table(title="all-reduce traffic per token per layer (bf16): 2 all-reduces of hidden values; "
                        "a ring moves 2(N-1)/N of it through each GPU's link")
    for column in ("model", "parameters", "hidden", "per token per layer", "through each link at N=8"):
        table.add_column(column, justify="right")
    for shape in shapes:
        per = allreduce_bytes_per_token_per_layer(shape.hidden)
        table.add_row(shape.name, f"{shape.parameters / 1e9:.1f}B", f"{shape.hidden:,}", format_bytes(per),
                      format_bytes(2 * per * 7 / 8))
    console.print(table)
    verdicts = {}
    for link, grid in zip(LINKS, grids):
        verdicts[link.name] = said = {}
        for shape, speedup, fits_one in zip(shapes, grid["speedup"], grid["fits_one"]):
            pays = [b for b, s in zip(BATCHES, speedup) if s > 1]
            if np.isnan(speedup).all():
                said[shape.name] = f"does not fit {link.ranks} GPUs"
            elif not fits_one.any():
                said[shape.name] = "too big for one GPU: it needs the split"
            else:
                said[shape.name] = f"faster at batch {', '.join(map(str, pays))}" if pays else "never faster"
        console.print(f"[bold]{link.name}[/] (N={link.ranks}) against one GPU: "
                      + "; ".join(f"{name} {verdict}" for name, verdict in said.items()))
    title = (f"Tensor parallelism on paper: one decode step of B sequences of {CONTEXT:,} tokens, bf16, "
             f"{GPU.name} ({GPU.hbm_bandwidth / 1e12:.2f} TB/s, {GPU.flops / 1e12:.0f} TFLOP/s), compute and "
             f"communication not overlapped\n† the model and its KV cache do not fit one GPU (the speed-up is "
             f"against an imaginary GPU with room for them); bandwidths from the datasheets, latencies assumed")
    fig = plot_tp_cost(grids, LINKS, [s.name for s in shapes], BATCHES, title)
    return dict(gpu=vars(GPU), context=CONTEXT, batches=BATCHES, links=[vars(link) for link in LINKS],
                shapes=[vars(s) for s in shapes], speedup={link.name: g["speedup"].tolist() for link, g in
                                                           zip(LINKS, grids)},
                fits_one_gpu={link.name: g["fits_one"].tolist() for link, g in zip(LINKS, grids)},
                pays=verdicts), fig


def cell(grid: dict, way: str, key: str, shape: int, batch: int, scale: float = 1.0) -> str:
    """One number of the copies-or-splits table (thousands as k, to fit a terminal), or "—" where
    that way does not fit."""
    value = grid[way][key][shape, CURVE_BATCHES.index(batch)] * scale
    if np.isnan(value):
        return "—"
    return f"{value / 1e3:.0f}k" if value >= 1e4 else f"{value / 1e3:.1f}k" if value >= 1e3 else f"{value:.3g}"


def copies_against_splits() -> tuple[dict, plots.Figure]:
    """8 whole copies against an 8-way split inside one node (NVLink, PCIe) and one GPU, on paper."""
    shapes = model_shapes()
    links = [link for link in LINKS if link.ranks == 8]
    n = links[0].ranks
    grids = [copies_or_splits(shapes, CURVE_BATCHES, link, CONTEXT) for link in links]
    table = Table(title=f"copies or splits on paper, {GPU.name}, B sequences of {CONTEXT:,} tokens, bf16: tokens/s, "
                        f"then ms per step (a token's latency); — does not fit")
    splits = [f"split {link.name.split(', ')[-1].split()[0]}" for link in links]
    table.add_column("model", no_wrap=True)
    for column in ("B", "1 GPU", f"{n} copies", *splits, "ms: copies", splits[0]):
        table.add_column(column, justify="right")
    for i, shape in enumerate(shapes):
        for b in TABLE_BATCHES:
            table.add_row(shape.name if b == TABLE_BATCHES[0] else "", f"{b:,}",
                          *(cell(grids[0], way, "tokens_per_second", i, b) for way in ("one GPU", "copies")),
                          *(cell(grid, "split", "tokens_per_second", i, b) for grid in grids),
                          cell(grids[0], "copies", "step_seconds", i, b, 1e3),
                          cell(grids[0], "split", "step_seconds", i, b, 1e3))
    console.print(table)
    # A model that fits no N GPUs even split (405B) has nothing to draw: the title names it instead.
    fits = [i for i in range(len(shapes)) if not np.isnan(grids[0]["split"]["tokens_per_second"][i]).all()]
    left_out = [f"{s.name} ({s.parameters * 2 / 1e9:,.0f} GB in bf16)" for i, s in enumerate(shapes) if i not in fits]
    title = (f"Copies or splits on paper: {n} {GPU.name} as {n} whole copies or one {n}-way split; one decode step "
             f"of B sequences of {CONTEXT:,} tokens, bf16; copies never communicate"
             + (f"\nleft out: {', '.join(left_out)}, which fits no {n} of them" if left_out else ""))
    drawn = [{way: {key: values[fits] for key, values in grid[way].items()} for way in grid} for grid in grids]
    fig = plot_copies_or_splits_cost(drawn, links, [shapes[i].name for i in fits], CURVE_BATCHES, title)
    return dict(gpu=vars(GPU), context=CONTEXT, batches=CURVE_BATCHES, shapes=[s.name for s in shapes],
                links=[vars(link) for link in links],
                ways={link.name: {way: {key: values.tolist() for key, values in grid[way].items()} for way in grid}
                      for link, grid in zip(links, grids)}), fig


def cost_models() -> dict:
    """Both cost models: their tables, figures and numbers (no model is loaded)."""
    facts = {}
    facts["cost_model"], fig = cost_model()
    console.print(f"saved {plots.save(fig, '14_tp_cost')}")
    facts["copies_or_splits_cost"], fig = copies_against_splits()
    console.print(f"saved {plots.save(fig, '14_copies_or_splits_cost')}")
    return facts


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4", help="tensor-parallel sizes to compare, e.g. 1,2,4")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (default 1)")
    parser.add_argument("--requests", type=int, default=16, help="requests decoding side by side")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens of each request")
    parser.add_argument("--output", type=int, default=32, help="output tokens of each request")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per size (the median is kept)")
    parser.add_argument("--sample-tokens", type=int, default=32, help="tokens of the sample")
    parser.add_argument("--cost-only", action="store_true",
                        help="only the cost models on paper (tables, figures, 14_cost_model.json); no model runs")
    args = parser.parse_args()
    try:
        args.sizes = [int(n) for n in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: comma-separated integers, got {args.sizes!r}")
    for name in ("threads", "requests", "prompt", "output", "repeats", "sample_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.sizes):
        parser.error(f"--sizes must all be at least 1, got {args.sizes}")
    if args.cost_only:
        start = time.perf_counter()
        path = save_results("14_cost_model", dict(created=time.strftime("%Y-%m-%d %H:%M:%S"), **cost_models()))
        console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")
        return
    torch.set_num_threads(args.threads)  # each rank copies rank 0's number of threads
    model = load_for_chapter(args)
    args.sizes = splittable(model, args.sizes)
    tokenizer = load_tokenizer(args.model)
    label = f"{args.model or 'the embedded model'} ({model.config.num_parameters() / 1e6:.1f}M parameters)"
    start = time.perf_counter()

    facts = dict(sample=sample(model, tokenizer, args.sample_tokens))
    facts["sharded_layer"], fig = layer_picture(model, args.model or "the embedded model")
    console.print(f"saved {plots.save(fig, '14_sharded_layer')}")
    suffix = "" if model.device.type == "cpu" else f"_{model.device.type}"
    facts["step_split"], fig = step_split(model, args, label)
    console.print(f"saved {plots.save(fig, '14_step_split' + suffix)}")
    facts.update(cost_models())
    path = save_results(f"14_tensor_parallelism_{model.device.type}", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"), engine=ENGINE,
        threads_per_rank=args.threads, load_average=list(os.getloadavg()), seconds=time.perf_counter() - start,
        **facts))
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
