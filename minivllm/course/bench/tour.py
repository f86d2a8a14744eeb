"""`minivllm tour`: every stage of the course on one seeded workload, side by side.

For each stage: useful output tokens per second, speed-up over naive decode, padding waste,
KV utilisation, peak memory, and whether its tokens agree with transformers' greedy output on
a sample of requests. Writes a rich table, JSON under benchmarks/results/, and a bar chart.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from minivllm.course import plots
from minivllm.course.bench.harness import (
    StageResult,
    console,
    format_bytes,
    format_tokens_per_second,
    run_stage,
    save_results,
)
from minivllm.course.bench.peers import (
    continuous_batching_unavailable,
    hf_generate_batch,
    hf_static_generate,
    to_transformers,
    token_positions,
)
from minivllm.course.bench.workloads import Workload, make_workload, warmup_workloads
from minivllm.course.plots.lines import plot_bars
from minivllm.loader import CONFIGS, default_device, load_model
from minivllm.machine import environment
from minivllm.model import Decoder
from minivllm.stages import ENGINES, STAGES
from minivllm.stages.common import StageStats
from minivllm.triton_support import use_interpreter

# On a large workload (nano: ~140k output tokens) the stages that serve one request, or one
# fixed-size group, after another would take hours; their rate does not depend on how many
# groups follow, so they run on a sample of requests and the rate is extrapolated (the row says
# so). The paged, continuous and Triton stages share memory across the whole workload and always
# run on all of it.
SAMPLED_STAGES = {"naive": 4, "kv_cache": 8, "static_batch": 32, "ragged_batch": 32, "chunked_prefill": 32}
LARGE_WORKLOAD_TOKENS = 20_000
# On a GPU the early stages are launch-bound (~30 ms per token for a 0.6B model on an H200: Python
# launches every kernel of every layer) whatever the workload's size, so a GPU samples from a much
# smaller size on, and smaller samples. The GPU tour's own workload (tour_gpu, ~900 output tokens)
# is below it: every stage serves every request, nothing is extrapolated.
GPU_SAMPLED_STAGES = {"naive": 2, "kv_cache": 4, "static_batch": 16, "ragged_batch": 16, "chunked_prefill": 8}
GPU_LARGE_WORKLOAD_TOKENS = 2_000
# The groups those stages serve one after another (the batch stages' default batch size): a sample
# grows a group at a time while the stage's time budget lasts.
SAMPLE_GROUP = {"naive": 1, "kv_cache": 1, "static_batch": 8, "ragged_batch": 8, "chunked_prefill": 8}
# Under a time limit, a stage left with less than this is skipped rather than measured on nothing.
MIN_STAGE_SECONDS = 2.0
# The tour's time limit on a GPU when none is given: the whole ladder in five minutes. (On one H200
# the tour without one printed no row in 167 s: the launch-bound stages ran whole samples.)
GPU_TIME_LIMIT = 300.0
# What `minivllm tour --device cuda` runs when not told otherwise: a real model shape (random
# weights) and a workload sized so that every stage's lesson shows and the whole ladder,
# transformers included, fits in about five minutes on one H100. In fp32: with random weights many
# greedy choices are near-ties, which bf16 rounding decides differently in different kernels, so a
# bf16 tour's "= HF" column would report kernels, not mistakes; in fp32 a ✓ means equal.
GPU_DEFAULT_MODEL = "qwen3-0.6b.json"
GPU_DEFAULT_WORKLOAD = "tour_gpu"
GPU_DEFAULT_DTYPE = torch.float32
# On a CPU, Triton kernels run only in Triton's interpreter (an emulator, thousands of times
# slower than compiled code): the tour runs them on a couple of requests to check the tokens.
INTERPRETER_SAMPLE = 2


def reference_outputs(hf: Any, workload: Workload, sample: list[int]) -> dict[int, list[int]]:
    """transformers' greedy tokens (one request at a time) for the sampled requests."""
    outputs = {}
    with torch.no_grad():
        for i in sample:
            ids = torch.tensor([workload.prompts[i]], device=hf.device)
            n = workload.output_lens[i]
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            outputs[i] = out[0, ids.shape[1]:].tolist()
    return outputs


def peer_runners(hf: Any, batch_size: int = 16, deadline: Callable[[], float | None] = lambda: None) -> dict[str, Any]:
    """transformers' own batched generation, wrapped like a stage (same prompts and lengths).
    Its continuous batching is left out, with a note, where the installed transformers has none;
    it stops at deadline() (a time.perf_counter() value, or None), and the requests it had not
    finished by then come back empty."""

    def static(model: Decoder, prompts: list[list[int]], lens: list[int], stats: StageStats) -> list[list[int]]:
        needed, padded = token_positions(prompts, lens, batch_size)  # padded rectangles: count that work
        stats.token_slots += padded
        stats.wasted_slots += padded - needed
        return hf_static_generate(hf, prompts, lens, batch_size)

    def continuous(model: Decoder, prompts: list[list[int]], lens: list[int], stats: StageStats) -> list[list[int]]:
        stats.token_slots += token_positions(prompts, lens, batch_size)[0]
        return [out or [] for out in hf_generate_batch(hf, prompts, lens, deadline=deadline())]

    runners = {f"transformers generate (static, batch {batch_size})": static}
    if reason := continuous_batching_unavailable():
        console.print(f"[yellow]transformers generate_batch left out:[/] {reason}")
    else:
        runners["transformers generate_batch"] = continuous
    return runners


def agreement(result: StageResult, reference: dict[int, list[int]]) -> str:
    """'✓' when every sampled request the stage ran has transformers' tokens, else '✗ k/n'.
    (A stage run on a sample of the workload, or stopped at its budget, is checked on the
    requests it finished: an empty output is one it never ran, as EOS is ignored.)"""
    checked = [i for i in reference if i < len(result.outputs) and result.outputs[i]]
    same = sum(result.outputs[i] == reference[i] for i in checked)
    return "✓" if same == len(checked) else f"✗ {same}/{len(checked)}"


def run_tour(
    source: Any = None, device: str | None = None, dtype: torch.dtype | None = None, workload: str | None = None,
    stages: list[str] | None = None, num_requests: int | None = None, seed: int = 0, check: int = 4,
    figure: str | None = None, results_name: str | None = None, peers: bool = True, time_limit: float | None = None,
) -> dict[str, Any]:
    """Run the ladder; returns the JSON payload (also written to benchmarks/results/ after every
    stage, "complete": false until the last). On a GPU the model defaults to the Qwen3-0.6B shape
    and the workload to "ladder_gpu".

    time_limit: seconds for the whole tour (default: GPU_TIME_LIMIT on a GPU, none on a CPU). Each
    stage then gets an equal share of what is left when it starts: a sampled stage runs one group of
    requests after another until its share is spent (at least one group), transformers' continuous
    batching stops at it, and a stage that starts with under MIN_STAGE_SECONDS left is skipped and
    named in the results. dtype: the model's (default: GPU_DEFAULT_DTYPE on a GPU)."""
    started = time.perf_counter()
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float))
                                   or not time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    on_gpu = (device or default_device()) == "cuda"
    time_limit = GPU_TIME_LIMIT if time_limit is None and on_gpu else time_limit
    if on_gpu and source is None:
        source = CONFIGS / GPU_DEFAULT_MODEL  # the embedded 4M model would measure only launch overhead
    workload = workload or (GPU_DEFAULT_WORKLOAD if on_gpu else "classroom")
    dtype = dtype or (GPU_DEFAULT_DTYPE if on_gpu else None)
    stages = stages or list(STAGES)
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown}; available: {', '.join(STAGES)}")
    if "triton" in stages and torch.device(device or default_device()).type == "cpu":
        use_interpreter()  # before the model is loaded: loading imports Triton, which decides then
    model = load_model(source, device=device, dtype=dtype)
    work = make_workload(workload, model.config.vocab_size, seed=seed, num_requests=num_requests)
    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens))
    if longest > model.config.max_position_embeddings:
        raise ValueError(f"workload {workload!r} needs {longest} positions; the model has "
                         f"{model.config.max_position_embeddings}")
    console.print(f"[bold]tour[/] {work.describe()}")
    sample = list(range(min(check, len(work.prompts))))
    hf = to_transformers(model)
    with console.status("transformers reference for the agreement check..."):
        reference = reference_outputs(hf, work, sample)
    end = started + time_limit if time_limit else None
    stage_end: list[float | None] = [None]  # the running stage's deadline, read by transformers' runner
    runners = {name: STAGES[name] for name in stages} | (peer_runners(hf, deadline=lambda: stage_end[0]) if peers
                                                         else {})
    kind = model.device.type
    name_of_results = results_name or f"tour_{kind}_{workload}"
    rows: list[dict[str, Any]] = []
    payload = dict(environment=environment(model), workload=dict(name=work.name, description=work.describe(), seed=seed,
                   prompt_lens=[len(p) for p in work.prompts], output_lens=work.output_lens),
                   kv_bytes_per_token=model.config.kv_bytes_per_token(model.dtype), rows=rows,
                   created=time.strftime("%Y-%m-%d %H:%M:%S"), time_limit=time_limit, skipped=[])
    for left_to_run, (name, generate) in enumerate(runners.items()):
        budget = None if end is None else (end - time.perf_counter()) / (len(runners) - left_to_run)
        if budget is not None and budget < MIN_STAGE_SECONDS:
            payload["skipped"].append(name)
            console.print(f"{name}: skipped, {budget:.1f} s of the tour's time limit left for it")
            continue
        stage_start = time.perf_counter()
        stage_end[0] = None if budget is None else stage_start + budget
        rows.append(_run_one(name, generate, model, work, reference, stage_end[0]))
        base = next((r for r in rows if r["name"] == "naive"), rows[0])
        for r in rows:
            r["speedup"] = r["tokens_per_second"] / base["tokens_per_second"]
        payload["tour_seconds"] = time.perf_counter() - started
        save_results(name_of_results, payload, complete=False)  # a tour stopped later keeps this row
        r = rows[-1]
        console.print(f"{name}: {format_tokens_per_second(r['tokens_per_second'])} useful tok/s, "
                      f"{r['speedup']:.1f}x naive, same tokens as transformers {r['agrees']}, "
                      f"{time.perf_counter() - stage_start:.1f} s" + (f" ({r['note']})" if r["note"] else ""))
    del hf

    payload["tour_seconds"] = time.perf_counter() - started
    _print_table(payload)
    path = save_results(name_of_results, payload, complete=True)
    drawn = (f" and {plots.save(_ladder_figure(payload), figure or ('ladder' if kind == 'cpu' else f'ladder_{kind}'))}"
             if rows else ", no figure: no stage ran")
    console.print(f"saved {path}{drawn} (the whole tour took {payload['tour_seconds']:.0f} s)")
    return payload


def _run_one(name: str, generate: Any, model: Decoder, work: Workload, reference: dict[int, list[int]],
             deadline: float | None) -> dict[str, Any]:
    """One stage's row. `deadline` (time.perf_counter()) bounds a sampled stage's groups and
    transformers' continuous batching."""
    note = ""
    if name == "triton" and model.device.type == "cpu":
        work = work.subset(INTERPRETER_SAMPLE)
        note = f"Triton interpreter on CPU, {INTERPRETER_SAMPLE} requests: checks tokens, not speed"
    elif (sample := sample_size(name, work, model.device.type == "cuda")) is not None:
        return _run_sampled(name, generate, model, work.subset(sample), len(work.prompts), reference, deadline)
    options: dict[str, Any] = {}
    if name in ENGINES:
        # Building the engine allocates its KV pool and captures its CUDA graphs: set-up, not
        # generation, so it happens before the clock starts, and the timed run uses that engine.
        options["llm"] = ENGINES[name](model, work.prompts, work.output_lens)
    for warm in _warm_ups(work, model.device.type == "cuda" and name in ENGINES):
        generate(model, warm.prompts, warm.output_lens, stats=StageStats(), **options)
    result = run_stage(name, generate, model, work, **options)
    finished = sum(bool(out) for out in result.outputs)
    if finished < len(work.prompts):  # transformers stopped at the stage's budget
        note = f"stopped at its time budget: {finished} of {len(work.prompts)} requests finished"
    row = result.row() | dict(agrees=agreement(result, reference), note=note)
    row["peak_kv_bytes"] = result.stats.peak_kv_tokens * model.config.kv_bytes_per_token(model.dtype)
    return row


def _run_sampled(name: str, generate: Any, model: Decoder, sample: Workload, total: int,
                 reference: dict[int, list[int]], deadline: float | None) -> dict[str, Any]:
    """A stage that serves one request, or one group of SAMPLE_GROUP[name], after another: its rate
    does not depend on how many groups follow, so it runs group after group of `sample` until the
    sample or its time (`deadline`) runs out, at least one group, and the rate is extrapolated."""
    for warm in _warm_ups(sample, False):
        generate(model, warm.prompts, warm.output_lens, stats=StageStats())
    group = SAMPLE_GROUP[name]
    parts: list[StageResult] = []
    while len(parts) * group < len(sample.prompts) and (not parts or deadline is None or time.perf_counter() < deadline):
        ran = len(parts) * group
        piece = Workload(sample.name, sample.prompts[ran:ran + group], sample.output_lens[ran:ran + group])
        parts.append(run_stage(name, generate, model, piece))
    stats = StageStats(
        token_slots=sum(p.stats.token_slots for p in parts), wasted_slots=sum(p.stats.wasted_slots for p in parts),
        kv_used=sum(p.stats.kv_used for p in parts), kv_reserved=sum(p.stats.kv_reserved for p in parts),
        peak_kv_tokens=max(p.stats.peak_kv_tokens for p in parts))
    result = StageResult(name, sum(p.seconds for p in parts), sum(p.useful_tokens for p in parts), stats,
                         max((p.peak_gpu_bytes or 0 for p in parts), default=0) or None,
                         [out for p in parts for out in p.outputs])
    ran = len(result.outputs)
    note = f"ran {ran} of {total} requests, rate extrapolated" + (
        " (its time budget ended the sample)" if ran < len(sample.prompts) else "")
    row = result.row() | dict(agrees=agreement(result, reference), note=note)
    row["peak_kv_bytes"] = stats.peak_kv_tokens * model.config.kv_bytes_per_token(model.dtype)
    return row


def sample_size(name: str, work: Workload, on_gpu: bool) -> int | None:
    """How many of the workload's requests a stage runs when it runs a sample (None: all of them):
    the one-group-at-a-time stages, on a large workload only (GPU_LARGE_WORKLOAD_TOKENS output
    tokens on a GPU, LARGE_WORKLOAD_TOKENS on a CPU)."""
    if name not in SAMPLED_STAGES:
        return None
    sizes, large = (GPU_SAMPLED_STAGES, GPU_LARGE_WORKLOAD_TOKENS) if on_gpu else (SAMPLED_STAGES, LARGE_WORKLOAD_TOKENS)
    if work.num_output_tokens <= large or sizes[name] >= len(work.prompts):
        return None
    return sizes[name]


def _warm_ups(work: Workload, compiles: bool) -> list[Workload]:
    """What runs before a stage is timed. First calls pay for allocations and, on a GPU, Triton
    compiles a kernel for every path a step takes: an engine stage there runs warmup_workloads
    (every path the timed run will take) on the engine it is timed on; elsewhere a scrap of the
    workload does (two prompts cut to 8 tokens, 2 tokens each)."""
    if compiles:
        return warmup_workloads(work)
    return [Workload("warm-up", [p[:8] for p in work.prompts[:2]], [2] * min(2, len(work.prompts)))]


def _print_table(payload: dict[str, Any]) -> None:
    from rich.table import Table

    env = payload["environment"]
    table = Table(title=f"minivllm tour — {payload['workload']['description']}\n{env['device']}, {env['dtype']}")
    for column in ("stage", "useful tok/s", "vs naive", "padding waste", "KV util.", "peak memory", "= HF", "note"):
        table.add_column(column, justify="left" if column in ("stage", "note") else "right")
    for r in payload["rows"]:
        kv = r["kv_utilisation"]
        memory = (f"{format_bytes(r['peak_gpu_bytes'])} GPU" if r["peak_gpu_bytes"]
                  else f"{format_bytes(r['peak_kv_bytes'])} KV" if r["peak_kv_bytes"] else "—")
        table.add_row(r["name"], format_tokens_per_second(r["tokens_per_second"]), f"{r['speedup']:.1f}×",
                      f"{r['padding_waste']:.0%}", "—" if kv is None else f"{kv:.0%}", memory, r["agrees"], r["note"])
    console.print(table)


def markdown_table(payload: dict[str, Any]) -> str:
    """The tour's table as Markdown, for the README (same numbers as the JSON and the figure)."""
    lines = ["| stage | useful tok/s | vs naive | padding waste | KV utilisation | = transformers | note |",
             "|---|---:|---:|---:|---:|:---:|---|"]
    for r in payload["rows"]:
        kv = "—" if r["kv_utilisation"] is None else f"{r['kv_utilisation']:.0%}"
        lines.append(f"| {r['name']} | {format_tokens_per_second(r['tokens_per_second'])} | {r['speedup']:.1f}× | "
                     f"{r['padding_waste']:.0%} | {kv} | {r['agrees']} | {r['note']} |")
    return "\n".join(lines)


def _ladder_figure(payload: dict[str, Any]) -> plots.Figure:
    rows, env = payload["rows"], payload["environment"]
    model = env["model"]
    interpreted = [r["note"].startswith("Triton interpreter") for r in rows]
    extrapolated = [bool(r["note"]) and not i for r, i in zip(rows, interpreted)]
    labels = []
    for r, i, e in zip(rows, interpreted, extrapolated):
        label = f"{format_tokens_per_second(r['tokens_per_second'])}\n{r['speedup']:.1f}×" + (" *" if e else "")
        labels.append("interpreter:\ntokens checked,\nnot a speed" if i else label)
    colors = ["#a0aec0" if i else "#dd6b20" if r["name"].startswith("transformers") else "#2b6cb0"
              for r, i in zip(rows, interpreted)]
    names = [r["name"].replace("transformers ", "HF ").replace(" (static, batch ", "\n(static, batch ") for r in rows]
    return plot_bars(
        names, [r["tokens_per_second"] for r in rows], "useful output tokens / s (log scale)",
        "The ladder: every stage on the same workload", annotations=labels, logy=True, colors=colors,
        subtitle=f"{payload['workload']['description']}\n{model['model_type']} {model['parameters'] / 1e6:.1f}M params, "
                 f"{env['device']}, {env['dtype']}" + ("   (* extrapolated from a sample)" if any(extrapolated) else ""),
    )
