"""A roofline you can run: how close the engine comes to the memory floor of a workload (chapter 9).

    python benchmarks/engine_roofline.py [--device cpu|cuda] [--model SRC] [--dtype D] [--workload classroom|nano]
                                  [--variants eager graphs graphs+fused] [--repeats N] [--peer-requests N]

On a GPU (the numbers chapter 9 reports; benchmarks/gpu_runbook.py runs it as its roofline part):

    python benchmarks/engine_roofline.py --device cuda --model minivllm/configs/qwen3-0.6b.json --workload nano \
        --peer-requests 64 --peer-variants graphs+fused --time-limit 200

1. Measure the device's copy bandwidth (bytes read + written per second) and its read bandwidth
   (a sum over 1 GiB: bytes read); the floor is priced at the higher of the two, because on a
   GPU attention reads K/V a few percent faster than a copy moves it (course/bench/timing.py).
   The GPU's datasheet bandwidth (course/bench/roofline.py's DATASHEET_BANDWIDTH) prices it a
   second time: every share is stated at both, because published shares (nano-vllm, vLLM) are
   at the datasheet figure.
2. Compute the workload's floor: the weights read once per decode step, every request's KV
   read once per step it decodes, over that bandwidth (minivllm/course/bench/roofline.py).
3. Run the engine (`LLM.generate`, greedy, EOS ignored, each request's own output length)
   `--repeats` times per engine setting (`--variants`, default: every one the device can run,
   fastest first, so a run cut short still has the headline). Each setting gets an engine of its
   own, built (KV pool, CUDA graphs) and warmed up on the workload's own paths
   (course.bench.workloads.warmup_workloads: Triton compiles nothing on the clock) before its first
   timed run, and freed before the next one is built.
4. transformers' continuous batching (`generate_batch`) last, once on the same requests, or with
   `--peer-requests N` on the first N of them (it runs the nano workload at ~580 tok/s on an
   H100: over 4 minutes for all 256), which the `--peer-variants` settings also run, so that
   the speed-up compares the same work. With `--time-limit` it stops in time and its row counts
   the requests it finished.
5. Save benchmarks/results/09_roofline_<device>.json after every row ("complete": false until the
   last), check every runner produced the first setting's tokens, print a table (tok/s, share of
   the roofline of its own workload at the measured and at the datasheet bandwidth, speed
   against transformers), draw figures/09_roofline.png.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from minivllm import LLM, SamplingParams
from minivllm.course import plots
from minivllm.course.bench.harness import (chapter_parser, console, format_tokens_per_second, load_for_chapter, save_results,
                                    useful_tokens)
from minivllm.course.bench.workloads import WORKLOADS, Workload, make_workload, warmup_workloads
from minivllm.machine import environment, synchronize
from minivllm.model import Decoder
from minivllm.course.bench.peers import (PEER_SETTINGS, continuous_batching, continuous_batching_unavailable, generate_on,
                                         to_transformers)
from minivllm.course.plots.ceiling import plot_roofline
from minivllm.course.bench.profiling import VARIANTS, variants_for
from minivllm.course.bench.roofline import datasheet_bandwidth, decode_floor, roofline_shares
from minivllm.course.bench.timing import floor_bandwidth

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


def run_transformers(model: Decoder, work: Workload, warm: Workload,
                     deadline: float | None) -> tuple[float, list[list[int] | None]]:
    """transformers' continuous batching on a copy of the model with the same weights, run with
    PEER_SETTINGS: its manager started and warmed up before the clock starts (as an engine is
    built first), one timed run (its copy and KV cache are freed when this returns). Past
    `deadline` (time.perf_counter()) it stops: the requests it had not finished are None."""
    hf_model = to_transformers(model)
    with continuous_batching(hf_model, work.prompts, work.output_lens, PEER_SETTINGS) as manager:
        generate_on(manager, warm.prompts, warm.output_lens)
        return timed(lambda prompts, lens: generate_on(manager, prompts, lens, deadline=deadline), work,
                     model.device, PEER, bar=True)


def finish_row(row: dict, got: list[list[int] | None], reference: list[list[int]] | None, lens: list[int]) -> dict:
    """Fill in a row's numbers from its tokens: the median time, the useful tokens of the requests
    it finished (all of them, except a peer stopped at its deadline), tok/s, agreement with the
    first setting's tokens on the same requests (when it ran them)."""
    done = [(out, n, i) for i, (out, n) in enumerate(zip(got, lens)) if out is not None]
    row.update(median_seconds=statistics.median(row["seconds"]), requests_finished=f"{len(done)}/{len(got)}",
               useful_tokens=useful_tokens([out for out, _, _ in done], [n for _, n, _ in done]))
    row["tokens_per_second"] = row["useful_tokens"] / row["median_seconds"]
    row["same_tokens_as_engine"] = (None if reference is None else
                                    f"{sum(out == reference[i] for out, _, i in done)}/{len(done)}")
    return row


def measure(model: Decoder, work: Workload, variants: list[str], repeats: int, peer_work: Workload,
            peer_variants: list[str], peer_deadline: float | None) -> Iterator[dict]:
    """Yield one row per runner as it finishes: each engine setting on `work` (`repeats` runs, the
    median counts) and, when the peer runs a smaller `peer_work` (the first requests of `work`),
    each of `peer_variants` once on it; then transformers (one run on `peer_work`, stopped at
    `peer_deadline`), where the installed transformers has continuous batching. Each row names its
    workload; tokens are checked against the first setting's on the same requests."""
    device = model.device
    subset = len(peer_work.prompts) < len(work.prompts)
    outputs: dict[str, list[list[int]]] = {}  # the first setting's tokens, by workload
    for name in variants:
        # Repeats run the same prompts: without this, the prefix cache (chapter 11) would skip
        # their prefills, and the floor assumes every prompt is computed.
        llm = LLM(model, enable_prefix_caching=False, **VARIANTS[name])  # builds the pool, captures the graphs
        for warm in warmup_workloads(work):  # every path the timed runs take: Triton compiles now, not on the clock
            engine_runner(llm, progress=False)(warm.prompts, warm.output_lens)
        runs = [(work, repeats)] + ([(peer_work, 1)] if subset and name in peer_variants else [])
        for this, count in runs:
            seconds = []
            for repeat in range(count):
                label = f"minivllm ({name})" + (f", {this.name}" if this is not work else f", run {repeat + 1}/{count}")
                s, got = timed(engine_runner(llm, progress=True), this, device, label, bar=False)
                seconds.append(s)
                console.print(f"{label}: {s:.2f} s")
            outputs.setdefault(this.name, got)
            yield finish_row(dict(name=f"minivllm ({name})" + (f", {this.name}" if this is not work else ""),
                                  options=VARIANTS[name], workload=this.name, seconds=seconds),
                             got, outputs[this.name], this.output_lens)
        del llm
        free_memory(device)
    if reason := continuous_batching_unavailable():
        console.print(f"[yellow]{PEER} left out:[/] {reason}")
        return
    label = PEER if not subset else f"{PEER}, {peer_work.name}"
    s, got = run_transformers(model, peer_work, Workload("warm-up", work.prompts[:2], [4, 4]), peer_deadline)
    finished = sum(out is not None for out in got)
    console.print(f"{label}: {s:.2f} s" + (f", stopped at its deadline with {finished}/{len(got)} requests finished"
                                          if finished < len(got) else ""))
    free_memory(device)
    yield finish_row(dict(name=label, options={}, workload=peer_work.name, seconds=[s]), got,
                     outputs.get(peer_work.name), peer_work.output_lens)


def print_table(rows: list[dict], title: str) -> None:
    table = Table(title=title)
    for column in ("runner", "seconds", "requests", "tok/s", "of roofline (measured)", "of roofline (datasheet)",
                   "× transformers", "same tokens"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for row in rows:
        at_datasheet = row["share_of_datasheet_roofline"]
        table.add_row(row["name"], f"{row['median_seconds']:.2f}", row["requests_finished"],
                      format_tokens_per_second(row["tokens_per_second"]),
                      "—" if row["share_of_roofline"] is None else f"{row['share_of_roofline']:.1%}",
                      "—" if at_datasheet is None else f"{at_datasheet:.1%}",
                      "—" if row["speedup_over_transformers"] is None else f"{row['speedup_over_transformers']:.2f}×",
                      row["same_tokens_as_engine"] or "—")
    console.print(table)


def main() -> None:
    started = time.perf_counter()
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--workload", default="classroom", choices=list(WORKLOADS))
    parser.add_argument("--requests", type=int, default=None, help="requests (default: the workload's own count)")
    parser.add_argument("--variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="engine settings to run, in this order (default: every one the device can run, "
                             "fastest first)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each engine setting; the median counts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--machine-note", default="", help="what else the machine was doing, saved with the results")
    parser.add_argument("--peer-requests", type=int, default=None,
                        help="run transformers on the first N requests only (and engine settings on them too)")
    parser.add_argument("--peer-variants", nargs="+", default=None, choices=list(VARIANTS),
                        help="the engine settings that also run the peer's N requests (default: all of --variants)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds this script may take: transformers, last, stops in time for the script to "
                             "save, and reports the requests it finished")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.peer_requests is not None and args.peer_requests < 1:
        parser.error("--peer-requests must be at least 1")
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error("--time-limit must be positive")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_for_chapter(args)
    variants = args.variants or variants_for(model.device)[::-1]  # fastest first: a run cut short keeps the headline
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

    with console.status("measuring copy and read bandwidth"):
        rates = floor_bandwidth(model.device)
    bandwidth = rates["floor"]
    datasheet = datasheet_bandwidth(env["device"])
    prompt_lens = [len(p) for p in work.prompts]
    floor = decode_floor(model.config, model.dtype, prompt_lens, work.output_lens, bandwidth)
    console.print(f"[bold]bandwidth[/] copy {rates['copy'] / 1e9:,.1f} GB/s (read + write), read "
                  f"{rates['read'] / 1e9:,.1f} GB/s; the floor uses the higher  [bold]floor[/] "
                  f"{floor.weight_reads:,} weight reads × {floor.weight_bytes / 1e9:,.3f} GB + "
                  f"{floor.kv_bytes / 1e9:,.2f} GB of KV = {floor.seconds:.3f} s, "
                  f"{floor.tokens_per_second:,.0f} tok/s at most")
    console.print("[bold]datasheet[/] " + (f"{datasheet / 1e9:,.0f} GB/s: floor {floor.total_bytes / datasheet:.3f} s, "
                                            f"{floor.output_tokens * datasheet / floor.total_bytes:,.0f} tok/s at most"
                                            if datasheet else f"none for {env['device']}: shares at the measured "
                                                              "bandwidth only"))

    peer_work = work
    if args.peer_requests is not None and args.peer_requests < len(work.prompts):
        peer_work = work.subset(args.peer_requests)
        peer_work.name = f"first {args.peer_requests} requests"
    peer_floor = decode_floor(model.config, model.dtype, [len(p) for p in peer_work.prompts], peer_work.output_lens,
                              bandwidth)
    on_cpu = model.device.type == "cpu"
    payload = dict(
        environment=env, created=time.strftime("%Y-%m-%d %H:%M:%S"),
        machine_note=args.machine_note, load_average=dict(before=load_before),
        workload=dict(name=args.workload, seed=args.seed, description=work.describe(), prompt_lens=prompt_lens,
                      output_lens=work.output_lens),
        bandwidth=dict(bytes_per_second=bandwidth, copy_bytes_per_second=rates["copy"],
                       read_bytes_per_second=rates["read"], datasheet_bytes_per_second=datasheet,
                       method="the higher of: median of 10 device-to-device copies (read + write bytes), median "
                              "of 10 sums over 1 GiB (256 MiB on a CPU; bytes read)",
                       cpu_threads=torch.get_num_threads() if on_cpu else None),
        floor=floor.to_dict(),
        floor_at_datasheet=None if datasheet is None else decode_floor(
            model.config, model.dtype, prompt_lens, work.output_lens, datasheet).to_dict(),
        peer_workload=dict(name=peer_work.name, requests=len(peer_work.prompts), floor=peer_floor.to_dict()),
        floor_note=(f"on a CPU the weights ({floor.weight_bytes / 1e6:,.0f} MB) may stay in the last-level cache "
                    "between steps, and the floor assumes they come from memory: a guide here, not a hard bound"
                    if on_cpu else ""),
        repeats=args.repeats, rows=[],
    )
    name = f"09_roofline_{model.device.type}"
    # transformers gets what is left of --time-limit, less a margin to tear it down and save
    peer_deadline = started + args.time_limit - 15 if args.time_limit else None
    rows = payload["rows"]
    for row in measure(model, work, variants, args.repeats, peer_work, args.peer_variants or variants, peer_deadline):
        # share_of_roofline at the measured bandwidth, share_of_datasheet_roofline at the datasheet's; none for a
        # runner that did not finish its requests: it did not do the floor's work (and no ratio is taken against it)
        finished, asked = row["requests_finished"].split("/")
        row |= (roofline_shares(floor if row["workload"] == work.name else peer_floor, row["median_seconds"], datasheet)
                if finished == asked else dict(share_of_roofline=None, share_of_datasheet_roofline=None))
        rows.append(row)
        save_results(name, payload, complete=False)  # a run killed later keeps this row
    payload["peer_settings"] = PEER_SETTINGS.as_dict()
    peer = next((row["tokens_per_second"] for row in rows
                 if row["name"].startswith(PEER) and row["share_of_roofline"] is not None), None)
    for row in rows:
        row["speedup_over_transformers"] = (row["tokens_per_second"] / peer
                                            if peer and row["workload"] == peer_work.name else None)
    subtitle = (f"{args.workload} workload ({len(work.prompts)} requests), {shape}, {env['device']}, {env['dtype']}"
                + (f", median of {args.repeats}" if args.repeats > 1 else "")
                + (f"; rows marked '{peer_work.name}' ran those alone (share of their own floor)"
                   if peer_work is not work else ""))
    print_table(rows, f"the roofline: {subtitle}")
    payload["load_average"]["after"] = os.getloadavg()
    path = save_results(name, payload, complete=True)
    figure = plots.save(plot_roofline(rows, floor.to_dict(), subtitle), "09_roofline")
    console.print(f"saved {path} and {figure}")


if __name__ == "__main__":
    main()
