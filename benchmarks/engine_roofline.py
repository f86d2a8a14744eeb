"""A roofline you can run: how close the engine comes to the memory floor of a workload (chapter 9).

    python benchmarks/engine_roofline.py [--device cpu|cuda] [--model SRC] [--dtype D] [--workload classroom|nano]
                                  [--variants eager graphs graphs+fused] [--repeats N]

On a GPU (the numbers chapter 9 reports):

    python benchmarks/engine_roofline.py --device cuda --model minivllm/configs/qwen3-0.6b.json --workload nano

(at the speeds of the shared notes, about 1 minute per engine setting and 4 for transformers,
whose continuous batching runs the nano workload at ~580 tok/s on an H100).

1. Measure the device's copy bandwidth (bytes read + written per second).
2. Compute the workload's floor: the weights read once per decode step, every request's KV
   read once per step it decodes, over that bandwidth (minivllm/bench/roofline.py).
3. Run the engine (`LLM.generate`, greedy, EOS ignored, each request's own output length)
   `--repeats` times per engine setting (`--variants`, default: every one the device can run),
   after a warm-up, and transformers' continuous batching (`generate_batch`) once, on the same
   requests. Each setting gets an engine of its own, freed before the next one is built.
4. Check every runner produced the engine's tokens, print a table (tok/s, share of the
   roofline, speed against transformers), save benchmarks/results/09_roofline_<device>.json
   and figures/09_roofline.png.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from minivllm import LLM, SamplingParams, plots
from minivllm.bench.harness import (chapter_parser, console, format_tokens_per_second, load_for_chapter, save_results,
                                    useful_tokens)
from minivllm.bench.workloads import WORKLOADS, Workload, make_workload
from minivllm.machine import environment, synchronize
from minivllm.model import Decoder
from minivllm.bench.peers import continuous_batching_unavailable, hf_generate_batch, to_transformers
from minivllm.plots.ceiling import plot_roofline
from minivllm.bench.profiling import VARIANTS, variants_for
from minivllm.bench.roofline import decode_floor
from minivllm.bench.timing import copy_bandwidth

PEER = "transformers generate_batch"
Runner = Callable[[list[list[int]], list[int]], list[list[int]]]


def engine_runner(llm: LLM, progress: bool) -> Runner:
    def generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=progress)]

    return generate


def timed(run: Runner, work: Workload, device: torch.device, label: str, bar: bool) -> tuple[float, list[list[int]]]:
    """Seconds one run of the workload takes (device synchronised), and its tokens. With `bar`,
    a spinner with the time elapsed (for runners that show no progress of their own)."""
    with Progress(SpinnerColumn(), TextColumn(label), TimeElapsedColumn(), console=console, transient=True,
                  disable=not bar) as progress:
        progress.add_task("", total=None)
        synchronize(device)
        start = time.perf_counter()
        outputs = run(work.prompts, work.output_lens)
        synchronize(device)
        return time.perf_counter() - start, outputs


def free_memory(device: torch.device) -> None:
    """Give a finished engine's KV pool (and graphs) back before the next one takes its share."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_transformers(model: Decoder, work: Workload, warm: Workload) -> tuple[float, list[list[int]]]:
    """transformers' continuous batching on a copy of the model with the same weights: one
    warm-up, one timed run (its copy and KV cache are freed when this returns)."""
    hf_model = to_transformers(model)
    hf_generate_batch(hf_model, warm.prompts, warm.output_lens)
    return timed(lambda prompts, lens: hf_generate_batch(hf_model, prompts, lens), work, model.device, PEER, bar=True)


def measure(model: Decoder, work: Workload, variants: list[str], repeats: int) -> list[dict]:
    """One row per runner: each engine setting (`repeats` runs, the median counts), then transformers
    (one run), where the installed transformers has continuous batching."""
    device = model.device
    warm = Workload("warm-up", work.prompts[:2], [4, 4])
    rows, outputs = [], {}
    for name in variants:
        # Repeats run the same prompts: without this, the prefix cache (chapter 11) would skip
        # their prefills, and the floor assumes every prompt is computed.
        llm = LLM(model, enable_prefix_caching=False, **VARIANTS[name])
        engine_runner(llm, progress=False)(warm.prompts, warm.output_lens)  # first calls pay for allocation, JIT
        seconds = []
        for repeat in range(repeats):
            label = f"minivllm ({name}), run {repeat + 1}/{repeats}"
            s, outputs[name] = timed(engine_runner(llm, progress=True), work, device, label, bar=False)
            seconds.append(s)
            console.print(f"{label}: {s:.2f} s")
        rows.append(dict(name=f"minivllm ({name})", options=VARIANTS[name], seconds=seconds))
        del llm
        free_memory(device)
    if reason := continuous_batching_unavailable():
        console.print(f"[yellow]{PEER} left out:[/] {reason}")
    else:
        s, outputs[PEER] = run_transformers(model, work, warm)
        console.print(f"{PEER}: {s:.2f} s")
        rows.append(dict(name=PEER, options={}, seconds=[s]))
        free_memory(device)
    reference = outputs[variants[0]]
    for row, key in zip(rows, [*variants, PEER]):
        same = sum(a == b for a, b in zip(outputs[key], reference))
        row.update(median_seconds=statistics.median(row["seconds"]),
                   useful_tokens=useful_tokens(outputs[key], work.output_lens),
                   same_tokens_as_engine=f"{same}/{len(reference)}")
        row["tokens_per_second"] = row["useful_tokens"] / row["median_seconds"]
    return rows


def print_table(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    for column in ("runner", "seconds", "tok/s", "of roofline", "× transformers", "same tokens"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for row in rows:
        table.add_row(row["name"], f"{row['median_seconds']:.2f}", format_tokens_per_second(row["tokens_per_second"]),
                      f"{row['share_of_roofline']:.1%}",
                      "—" if row["speedup_over_transformers"] is None else f"{row['speedup_over_transformers']:.2f}×",
                      row["same_tokens_as_engine"])
    console.print(table)


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--workload", default="classroom", choices=list(WORKLOADS))
    parser.add_argument("--requests", type=int, default=None, help="requests (default: the workload's own count)")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="engine settings to run (default: every one the device can run)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each engine setting; the median counts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--machine-note", default="", help="what else the machine was doing, saved with the results")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_for_chapter(args)
    variants = args.variants or variants_for(model.device)
    unavailable = [v for v in variants if v not in variants_for(model.device)]
    if unavailable:
        parser.error(f"{', '.join(unavailable)} cannot run on {model.device.type}")
    work = make_workload(args.workload, model.config.vocab_size, seed=args.seed, num_requests=args.requests)
    env = environment(model)
    shape = (f"{env['model']['model_type']} {env['model']['parameters'] / 1e6:.1f}M params, "
             f"{model.config.num_layers} layers, {model.config.kv_bytes_per_token(model.dtype):,} KV bytes/token")
    console.print(f"[bold]device[/] {env['device']}  [bold]dtype[/] {env['dtype']}  [bold]model[/] {shape}")
    console.print(f"[bold]workload[/] {work.describe()}")
    load_before = os.getloadavg()

    with console.status("measuring copy bandwidth"):
        bandwidth = copy_bandwidth(model.device)
    prompt_lens = [len(p) for p in work.prompts]
    floor = decode_floor(model.config, model.dtype, prompt_lens, work.output_lens, bandwidth)
    console.print(f"[bold]copy bandwidth[/] {bandwidth / 1e9:,.1f} GB/s (read + write)  [bold]floor[/] "
                  f"{floor.weight_reads:,} weight reads × {floor.weight_bytes / 1e9:,.3f} GB + "
                  f"{floor.kv_bytes / 1e9:,.2f} GB of KV = {floor.seconds:.3f} s, "
                  f"{floor.tokens_per_second:,.0f} tok/s at most")

    rows = measure(model, work, variants, args.repeats)
    peer = next((row["tokens_per_second"] for row in rows if row["name"] == PEER), None)
    for row in rows:
        row["share_of_roofline"] = floor.seconds / row["median_seconds"]
        row["speedup_over_transformers"] = row["tokens_per_second"] / peer if peer else None
    subtitle = (f"{args.workload} workload ({len(work.prompts)} requests), {shape}, {env['device']}, {env['dtype']}"
                + (f", median of {args.repeats}" if args.repeats > 1 else ""))
    print_table(rows, f"the roofline: {subtitle}")

    on_cpu = model.device.type == "cpu"
    payload = dict(
        environment=env, created=time.strftime("%Y-%m-%d %H:%M:%S"),
        machine_note=args.machine_note, load_average=dict(before=load_before, after=os.getloadavg()),
        workload=dict(name=args.workload, seed=args.seed, description=work.describe(), prompt_lens=prompt_lens,
                      output_lens=work.output_lens),
        bandwidth=dict(bytes_per_second=bandwidth, method="median of 10 device-to-device copies, read + write bytes",
                       cpu_threads=torch.get_num_threads() if on_cpu else None),
        floor=floor.to_dict(),
        floor_note=(f"on a CPU the weights ({floor.weight_bytes / 1e6:,.0f} MB) may stay in the last-level cache "
                    "between steps, and the floor assumes they come from memory: a guide here, not a hard bound"
                    if on_cpu else ""),
        repeats=args.repeats, rows=rows,
    )
    path = save_results(f"09_roofline_{model.device.type}", payload)
    figure = plots.save(plot_roofline(rows, floor.to_dict(), subtitle), "09_roofline")
    console.print(f"saved {path} and {figure}")


if __name__ == "__main__":
    main()
