"""Chapter 8's kernel benchmark: paged decode attention against the ways PyTorch can do it, at
the speed of memory.

A decode problem is one layer's paged KV pool holding a batch of contexts in randomly placed
blocks, with Qwen3-0.6B's head layout. Every method is timed on the GPU as the replay of a
CUDA graph that holds it (bench.timing.replayable), as the engine's decode steps run from
chapter 9 on, and set against the measured copy bandwidth, the ceiling of a memory-bound
kernel. `python chapters/08_triton_kernel.py --device cuda` runs `benchmark`.

Besides batches of equal contexts, one *uneven* batch like the nano workload's decode steps
(`uneven_batch`: 256 sequences, contexts uniform on 100..2,048 tokens) sets the kernel's split
choices (one pass, 2, 4, 8 partitions, and decode_plan's) against SDPA on padded dense K/V with
a mask: uneven contexts are where one program per sequence leaves SMs idle at the end. Every
bandwidth is also given as a share of the copy bandwidth measured here and of the GPU's datasheet
figure (course/bench/roofline.py). `python chapters/08_triton_kernel.py --device cuda --only-uneven`
runs that batch alone (under a minute on an H200).
"""
from __future__ import annotations

import functools
import itertools
import random
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minivllm.course.bench.harness import console
from minivllm.course.bench.timing import copy_bandwidth, cuda_seconds, replayable

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128  # Qwen3-0.6B (minivllm/configs/qwen3-0.6b.json)
BLOCK_SIZE = 16
CONTEXTS = [128, 256, 512, 1024, 2048, 4096, 8192]  # swept at batch 64
BATCHES = [1, 4, 16, 64, 128]  # swept at context 4,096
TARGET = (64, 4096)  # the goals: >= 90 % of copy bandwidth at batch 64 x 4,096 tokens,
GOAL_OF_COPY = 0.90
GOAL_VS_SDPA = 1.5  # and within 1.5x of SDPA on dense K/V at every context of the sweep at batch 64
H100_SMS = 132  # for the narration, which describes the GPU the goals were set on
TRITON, SDPA = "triton (paged, in place)", "SDPA (pre-padded dense K/V)"
# The nano workload's decode batch: 256 sequences whose contexts (prompt 100-1,024 plus output so
# far) are spread uniformly over 100..2,048 tokens; the kernel's splits timed on it, P = 1 unsplit.
UNEVEN_BATCH, UNEVEN_CONTEXTS = 256, (100, 2048)
UNEVEN_SPLITS = [1, 2, 4, 8]
GRAPH_MAX_CONTEXT = 40960  # Qwen3-0.6B's longest context: the max_context_len the engine's CUDA graphs size for



def make_decode_problem(context_lens: list[int], device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """q [S, Hq, D] and a one-layer pool [num_blocks, BLOCK_SIZE, Hkv, D] holding each
    sequence's context in randomly placed blocks, with their block tables."""
    needed = [-(-c // BLOCK_SIZE) for c in context_lens]
    num_blocks = sum(needed)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n] + [-1] * (max(needed) - n))
        start += n
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    on_device = dict(generator=torch.Generator(device).manual_seed(seed), device=device, dtype=dtype)
    return dict(
        q=torch.randn(len(context_lens), HEADS, HEAD_DIM, **on_device),
        k_cache=torch.randn(shape, **on_device),
        v_cache=torch.randn(shape, **on_device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
    )


def decode_args(problem: dict[str, Any]) -> list[torch.Tensor]:
    """A problem's tensors in paged_decode's argument order (all but max_context_len)."""
    return [problem[n] for n in ("q", "k_cache", "v_cache", "block_tables", "context_lens")]


def decode_bytes(batch: int, context: int, dtype: torch.dtype) -> int:
    """The bytes a decode step must move: every sequence's K and V, plus its query and output."""
    return (2 * batch * context * KV_HEADS + 2 * batch * HEADS) * HEAD_DIM * dtype.itemsize


def one_layer_pool(num_blocks: int, device: torch.device, dtype: torch.dtype) -> Any:
    """A one-layer KVPool of BLOCK_SIZE-token blocks with the same random contents each call
    (KVPool only reads the model's shape, device and dtype, so a stand-in does)."""
    from minivllm.attention.paged import KVPool

    shape = SimpleNamespace(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    pool = KVPool(SimpleNamespace(config=shape, device=device, dtype=dtype), num_blocks, BLOCK_SIZE)
    generator = torch.Generator().manual_seed(1)
    pool.k.copy_(torch.randn(pool.k.shape, generator=generator))
    pool.v.copy_(torch.randn(pool.v.shape, generator=generator))
    return pool


def reference_decode(problem: dict[str, Any]) -> torch.Tensor:
    """Float64 decode attention, one sequence at a time, reading the pool through the tables."""
    from minivllm.attention.paged import gather_kv

    q = problem["q"].double()
    out = torch.empty_like(q)
    for s, ctx in enumerate(problem["context_lens"].tolist()):
        keys = gather_kv(problem["k_cache"], problem["block_tables"][s], ctx).double()
        values = gather_kv(problem["v_cache"], problem["block_tables"][s], ctx).double()
        keys, values = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (keys, values))
        scores = torch.einsum("hd,chd->hc", q[s], keys) / HEAD_DIM**0.5
        out[s] = torch.einsum("hc,chd->hd", scores.softmax(-1), values)
    return out


def decode_methods(kernels: Any, problem: dict[str, Any], max_context: int, skip_flex: bool) -> dict[str, Callable]:
    """The decode attentions to time on one problem, as zero-argument callables."""
    from minivllm.attention.paged import gather_kv, paged_decode

    args = decode_args(problem)
    methods: dict[str, Callable] = {
        "triton (paged, in place)": lambda: kernels.paged_decode(*args, max_context),
        "PyTorch paged (gather, then attend)": lambda: paged_decode(*args, max_context),
    }
    # The dense baselines get their K/V already gathered and padded to [S, Hkv, L, D] (not
    # timed): the best case for them, as if the cache were one contiguous tensor per sequence.
    def dense(cache: torch.Tensor) -> torch.Tensor:
        rows = [gather_kv(cache, table, max_context) for table in problem["block_tables"]]
        return torch.stack(rows).transpose(1, 2).contiguous()

    dense_k, dense_v = dense(problem["k_cache"]), dense(problem["v_cache"])
    q4 = problem["q"][:, :, None, :]  # [S, Hq, 1, D]
    sdpa = F.scaled_dot_product_attention
    try:
        sdpa(q4, dense_k, dense_v, enable_gqa=True)
        methods["SDPA (pre-padded dense K/V)"] = lambda: sdpa(q4, dense_k, dense_v, enable_gqa=True)
    except TypeError:  # torch < 2.5: no enable_gqa; repeat the KV heads (also not timed)
        group = HEADS // KV_HEADS
        rk, rv = dense_k.repeat_interleave(group, 1), dense_v.repeat_interleave(group, 1)
        methods["SDPA (pre-padded dense K/V)"] = lambda: sdpa(q4, rk, rv)
    if not skip_flex:
        flex = compiled_flex_attention()
        if flex is not None:
            methods["FlexAttention (pre-padded dense K/V)"] = lambda: flex(q4, dense_k, dense_v, enable_gqa=True)
    return methods


@functools.cache
def compiled_flex_attention() -> Callable | None:
    """torch.compile(flex_attention) where this PyTorch has it (2.5+), else None."""
    try:
        from torch.nn.attention.flex_attention import flex_attention

        return torch.compile(flex_attention)  # recompiles as shapes change, then goes dynamic
    except (ImportError, RuntimeError) as error:
        console.print(f"[yellow]FlexAttention unavailable: {error}")
        return None


EAGER = "triton, eager launches"


def show(value: float | None, form: str, scale: float = 1.0) -> str:
    """value * scale formatted, or a dash for a point that could not be measured."""
    return "—" if value is None else format(value * scale, form)


def decode_sweep(kernels: Any, device: torch.device, dtype: torch.dtype, points: list[tuple[int, int]],
                 skip_flex: bool) -> dict[str, Any]:
    """Seconds and GB/s of every method at each (batch, context) point, each timed as a graph
    replay (`timing` says where a method had to be timed eagerly), plus the Triton kernel
    timed eagerly and its number of partitions. Bytes counted are the ones a decode step must
    move: the real context's K and V, plus q and the output."""
    seconds: dict[str, list[float | None]] = {}
    bandwidth: dict[str, list[float | None]] = {}
    timing: dict[str, list[str | None]] = {}
    partitions = []
    block_n = kernels.decode_tiles(HEAD_DIM, dtype.itemsize)[0]
    for i, (batch, context) in enumerate(points):
        problem = make_decode_problem([context] * batch, device, dtype, seed=i)
        useful = decode_bytes(batch, context, dtype)
        partitions.append(kernels.decode_plan(batch, KV_HEADS, context, block_n, kernels.sm_count(device)))
        methods = decode_methods(kernels, problem, context, skip_flex)
        for name, fn in [*methods.items(), (EAGER, methods[TRITON])]:
            try:
                runner, how = (fn, "eager") if name == EAGER else replayable(fn)
                t = cuda_seconds(runner)
            except Exception as error:  # e.g. out of memory, or a compile failure in a baseline
                console.print(f"[yellow]{name} at batch {batch} × {context}: {type(error).__name__}: {error}")
                t, how = None, None
            seconds.setdefault(name, [None] * i).append(t)
            bandwidth.setdefault(name, [None] * i).append(useful / t / 1e9 if t else None)
            timing.setdefault(name, [None] * i).append(how)
        console.print(f"  batch {batch:>4} × {context:>6,} tokens: " + ", ".join(
            f"{n.split(' (')[0]} {seconds[n][-1] * 1e6:,.0f} µs" for n in seconds if seconds[n][-1]))
        del problem, methods
        torch.cuda.empty_cache()
    return dict(seconds=seconds, bandwidth=bandwidth, timing=timing, partitions=partitions)


def goals(by_context: dict[str, Any], copy_gbs: float, datasheet_gbs: float | None, dtype: torch.dtype) -> dict[str, Any]:
    """The Triton kernel against SDPA on dense K/V and against copy bandwidth at every context
    of the batch-64 sweep (and against the datasheet bandwidth, where known): a table, and the
    goals (set against copy bandwidth) met or not."""
    from rich.table import Table

    triton_s, sdpa_s = by_context["seconds"][TRITON], by_context["seconds"].get(SDPA, [None] * len(CONTEXTS))
    ratio = [t / s if t and s else None for t, s in zip(triton_s, sdpa_s)]
    of_copy = [b / copy_gbs if b else None for b in by_context["bandwidth"][TRITON]]
    of_datasheet = [b / datasheet_gbs if b and datasheet_gbs else None for b in by_context["bandwidth"][TRITON]]
    table = Table(title=f"Decode attention at batch {TARGET[0]}, {str(dtype).removeprefix('torch.')}, "
                        f"{HEADS} q / {KV_HEADS} kv heads × {HEAD_DIM} (GPU time: graph replays)")
    for column in ("context", "partitions", "triton µs", "SDPA µs", "triton / SDPA", "triton % of copy",
                   "triton % of datasheet", "SDPA % of copy", "triton eager µs"):
        table.add_column(column, justify="right")
    sdpa_gbs = by_context["bandwidth"].get(SDPA, [None] * len(CONTEXTS))
    eager_s = by_context["seconds"][EAGER]
    for i, context in enumerate(CONTEXTS):
        table.add_row(f"{context:,}", str(by_context["partitions"][i]), show(triton_s[i], ",.1f", 1e6),
                      show(sdpa_s[i], ",.1f", 1e6), show(ratio[i], ".2f") + "×", show(of_copy[i], ".0%"),
                      show(of_datasheet[i], ".0%"),
                      show(sdpa_gbs[i], ".0%", 1 / copy_gbs), show(eager_s[i], ",.1f", 1e6))
    console.print(table)
    worst = None if None in ratio else max(ratio)  # a context that was not measured meets no goal
    at_target = of_copy[CONTEXTS.index(TARGET[1])]
    result = dict(ratio_vs_sdpa=ratio, of_copy=of_copy, of_datasheet=of_datasheet, worst_ratio_vs_sdpa=worst,
                  of_copy_at_target=at_target,
                  goal_vs_sdpa=GOAL_VS_SDPA, goal_of_copy=GOAL_OF_COPY,
                  met_vs_sdpa=worst is not None and worst <= GOAL_VS_SDPA,
                  met_of_copy=at_target is not None and at_target >= GOAL_OF_COPY)
    for met, text in ((result["met_vs_sdpa"], f"within {GOAL_VS_SDPA}× of SDPA at every context "
                       f"{CONTEXTS[0]:,}–{CONTEXTS[-1]:,} (worst: {show(worst, '.2f')}×)"),
                      (result["met_of_copy"], f"≥ {GOAL_OF_COPY:.0%} of copy bandwidth at batch {TARGET[0]} × "
                       f"{TARGET[1]:,} ({show(at_target, '.0%')})")):
        console.print(f"  [bold]goal[/]: {text}: " + ("[green]met" if met else "[red]not met"))
    return result


def split_sweep(kernels: Any, device: torch.device, dtype: torch.dtype, copy_gbs: float) -> list[dict[str, Any]]:
    """The decode kernel's split (partitions), tiles and pipeline depth at a short, a middle and
    the target context, at batch 64: where the automatic choice (decode_plan, decode_tiles)
    stands against the best measured, so that their constants can be tuned on a new GPU."""
    rows = []
    defaults = kernels.decode_tiles(HEAD_DIM, dtype.itemsize)
    for batch, context in ((TARGET[0], 256), (TARGET[0], 1024), TARGET):
        problem = make_decode_problem([context] * batch, device, dtype)
        args = decode_args(problem)
        useful = decode_bytes(batch, context, dtype)
        auto = kernels.decode_plan(batch, KV_HEADS, context, defaults[0], kernels.sm_count(device))
        for partitions in sorted({1, 2, 4, 8, 16, auto}):
            for tiles in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):  # BLOCK_N, warps, stages
                config = dict(partition_size=-(-context // partitions), block_n=tiles[0], num_warps=tiles[1],
                              num_stages=tiles[2])
                try:
                    runner, how = replayable(functools.partial(kernels.paged_decode, *args, context, **config))
                    t = cuda_seconds(runner)
                except Exception as error:  # e.g. more shared memory than an SM has
                    console.print(f"[yellow]  {config} at batch {batch} × {context}: {type(error).__name__}")
                    continue
                rows.append(dict(batch=batch, context=context, partitions=partitions, block_n=tiles[0],
                                 num_warps=tiles[1], num_stages=tiles[2],
                                 automatic=(partitions, *tiles) == (auto, *defaults), timing=how, seconds=t,
                                 gbs=useful / t / 1e9, of_copy=useful / t / 1e9 / copy_gbs))
        point = [r for r in rows if r["context"] == context]
        best, chosen = max(point, key=lambda r: r["gbs"]), next(r for r in point if r["automatic"])
        for name, r in (("best", best), ("automatic", chosen)):
            console.print(f"  batch {batch} × {context:,}, {name}: {r['partitions']} partitions, BLOCK_N "
                          f"{r['block_n']}, {r['num_warps']} warps, {r['num_stages']} stages: "
                          f"{r['seconds'] * 1e6:,.1f} µs = {r['of_copy']:.0%} of copy")
        del problem, args
        torch.cuda.empty_cache()
    return rows


def uneven_contexts(batch: int = UNEVEN_BATCH, bounds: tuple[int, int] = UNEVEN_CONTEXTS, seed: int = 0) -> list[int]:
    """`batch` context lengths drawn uniformly from bounds[0]..bounds[1] (inclusive) with a seeded RNG."""
    rng = random.Random(seed)
    return [rng.randint(*bounds) for _ in range(batch)]


def masked_sdpa(problem: dict[str, Any], longest: int) -> Callable[[], torch.Tensor]:
    """SDPA over each sequence's K/V gathered into a dense [S, Hkv, longest, D] tensor (not timed:
    the best case for it), the padding past each context masked: what dense attention must do
    with uneven contexts, reading every sequence's K/V as if it were the longest. The query heads
    that share a KV head are that head's query rows (as paged.paged_decode does), so each K/V byte
    is read once, with no repeated heads and no reliance on enable_gqa's kernels."""
    from minivllm.attention.paged import gather_kv

    def dense(cache: torch.Tensor) -> torch.Tensor:
        rows = [gather_kv(cache, table, longest) for table in problem["block_tables"]]
        return torch.stack(rows).transpose(1, 2).contiguous()

    dense_k, dense_v = dense(problem["k_cache"]), dense(problem["v_cache"])
    lens = problem["context_lens"]
    mask = (torch.arange(longest, device=lens.device)[None, :] < lens[:, None])[:, None, None, :]  # [S, 1, 1, L]
    S = len(lens)
    grouped = problem["q"].view(S, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)  # query head h -> KV head h // group
    return lambda: F.scaled_dot_product_attention(grouped, dense_k, dense_v, attn_mask=mask).view(S, HEADS, HEAD_DIM)


def uneven_methods(kernels: Any, problem: dict[str, Any], splits: list[int]) -> dict[str, tuple[int, Callable]]:
    """The decode attentions of the uneven batch, name -> (partitions, zero-argument callable):
    the Triton kernel with each of `splits` partitions (1: one pass, no merge), with decode_plan's
    own choice, and masked SDPA on padded dense K/V (partitions 0)."""
    args = decode_args(problem)
    longest = int(problem["context_lens"].max())
    block_n = kernels.decode_tiles(HEAD_DIM, problem["k_cache"].element_size())[0]
    auto = kernels.decode_plan(len(problem["q"]), KV_HEADS, longest, block_n, kernels.sm_count(problem["q"].device))
    methods: dict[str, tuple[int, Callable]] = {}
    for P in splits:
        size = -(-longest // P)  # partitions of `size` tokens of the longest context: P of them
        actual = kernels.decode_plan(len(problem["q"]), KV_HEADS, longest, block_n, 1, partition_size=size)
        methods[f"triton, {actual} partition{'s' * (actual > 1)}"] = (
            actual, functools.partial(kernels.paged_decode, *args, longest, partition_size=size))
    methods[f"triton, decode_plan's choice ({auto})"] = (auto, functools.partial(kernels.paged_decode, *args, longest))
    methods["SDPA (pre-padded dense K/V, masked)"] = (0, masked_sdpa(problem, longest))
    return methods


def uneven_batch(kernels: Any, device: torch.device, dtype: torch.dtype, copy_gbs: float,
                 datasheet_gbs: float | None) -> dict[str, Any]:
    """The nano workload's decode batch (UNEVEN_BATCH sequences, contexts uniform on
    UNEVEN_CONTEXTS): each method's error against float64, its time as a graph replay, and the
    bandwidth it achieves on the bytes a decode step must move (every real context's K and V, q
    and the output; SDPA also reads the padding, which is its price), as a share of the copy
    bandwidth measured here and of the datasheet figure. Also the split decode_plan gives under
    the engine's CUDA graphs, which size the grid for GRAPH_MAX_CONTEXT tokens."""
    from rich.table import Table

    contexts = uneven_contexts()
    problem = make_decode_problem(contexts, device, dtype, seed=7)
    useful = sum(decode_bytes(1, context, dtype) for context in contexts)
    expected = reference_decode(problem)
    block_n = kernels.decode_tiles(HEAD_DIM, dtype.itemsize)[0]
    rows = []
    for name, (partitions, fn) in uneven_methods(kernels, problem, UNEVEN_SPLITS).items():
        try:
            error = (fn().double() - expected).abs().max().item()
            runner, how = replayable(fn)
            t = cuda_seconds(runner)
        except Exception as failure:  # e.g. out of memory, or a baseline with no kernel for this shape
            console.print(f"[yellow]{name} on the uneven batch: {type(failure).__name__}: {failure}")
            continue
        gbs = useful / t / 1e9
        rows.append(dict(name=name, partitions=partitions, timing=how, seconds=t, max_abs_error_vs_float64=error,
                         gbs=gbs, of_copy=gbs / copy_gbs, of_datasheet=gbs / datasheet_gbs if datasheet_gbs else None))
    table = Table(title=f"Decode attention on an uneven batch: {len(contexts)} sequences, contexts "
                        f"{min(contexts):,}-{max(contexts):,} (mean {sum(contexts) / len(contexts):,.0f}), "
                        f"{str(dtype).removeprefix('torch.')} (GPU time: graph replays)")
    for column in ("method", "µs", "GB/s", "% of copy", "% of datasheet", "max |error| vs float64"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for r in rows:
        table.add_row(r["name"], f"{r['seconds'] * 1e6:,.1f}", f"{r['gbs']:,.0f}", f"{r['of_copy']:.0%}",
                      show(r["of_datasheet"], ".0%"), f"{r['max_abs_error_vs_float64']:.1e}")
    console.print(table)
    sms = kernels.sm_count(device)
    plan = kernels.decode_plan(len(contexts), KV_HEADS, max(contexts), block_n, sms)
    plan_under_graphs = kernels.decode_plan(len(contexts), KV_HEADS, GRAPH_MAX_CONTEXT, block_n, sms)
    best = max((r for r in rows if r["partitions"] > 0), key=lambda r: r["gbs"], default=None)
    if best:
        console.print(f"  fastest: {best['name']} ({best['of_copy']:.0%} of copy); decode_plan chooses {plan} "
                      f"partition(s) here and {plan_under_graphs} under a CUDA graph sized for {GRAPH_MAX_CONTEXT:,} "
                      f"tokens ({sms} SMs)")
    return dict(batch=len(contexts), context_bounds=list(UNEVEN_CONTEXTS), contexts=contexts, useful_bytes=useful,
                sms=sms, copy_bandwidth_gbs=copy_gbs, datasheet_bandwidth_gbs=datasheet_gbs, plan=plan,
                plan_under_graphs=plan_under_graphs, fastest=best["name"] if best else None, rows=rows)


def engine_throughput(args: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The continuous engine on a nano-style workload, attention="torch" vs "triton"."""
    from minivllm.course import plots
    from minivllm.course.bench.harness import results_table, run_stage
    from minivllm.course.bench.workloads import make_workload, warmup_workloads
    from minivllm.course.plots.lines import plot_bars
    from minivllm.loader import CONFIGS, load_model
    from minivllm.stages import continuous
    from minivllm.stages import triton as triton_stage

    source = args.model or CONFIGS / "qwen3-0.6b.json"
    model = load_model(source, device=str(device), dtype=dtype)
    workload = make_workload("nano", model.config.vocab_size, args.seed, num_requests=args.e2e_requests)
    console.print(f"  {source} on {device}, {str(dtype).removeprefix('torch.')}; {workload.describe()}")
    results = []
    for name, stage in {"torch": continuous, "triton": triton_stage}.items():
        # The engine is built, and its kernels compiled on every path the timed run takes, before the clock starts.
        llm = stage.engine_for(model, workload.prompts, workload.output_lens)
        for warm in warmup_workloads(workload):
            stage.generate(model, warm.prompts, warm.output_lens, llm=llm)
        results.append(run_stage(name, stage.generate, model, workload, llm=llm))
        del llm
    console.print(results_table(results, "Engine throughput by attention backend"))
    same = sum(a == b for a, b in zip(results[0].outputs, results[1].outputs))
    console.print(f"  identical greedy outputs: {same} of {len(workload.prompts)} requests"
                  + ("" if dtype == torch.float32 else " (the two attentions round differently in 16-bit floats and "
                     "random weights make near-ties common, so some requests may drift apart)"))
    fig = plot_bars([f"attention={r.name!r}" for r in results], [r.tokens_per_second for r in results],
                    "useful output tok/s", "Engine throughput: PyTorch vs Triton paged attention",
                    [f"{r.tokens_per_second:,.0f} tok/s" for r in results], subtitle=workload.describe())
    console.print(f"saved {plots.save(fig, '08_engine_throughput')}")
    return dict(workload=workload.describe(), model=str(source), results=[r.row() for r in results],
                identical_outputs=same)


def bandwidths(device: torch.device) -> tuple[str, float, float | None]:
    """(the GPU's name, its measured copy bandwidth, its datasheet bandwidth or None), in GB/s."""
    from minivllm.course.bench.roofline import datasheet_bandwidth
    from minivllm.machine import device_name

    gpu = device_name(device)
    copy_gbs, datasheet = copy_bandwidth(device) / 1e9, datasheet_bandwidth(gpu)
    console.print(f"  copy bandwidth on {gpu}: {copy_gbs:,.0f} GB/s (1 GiB device-to-device, read + write); "
                  + (f"datasheet {datasheet / 1e9:,.0f} GB/s" if datasheet else "no datasheet figure for it"))
    return gpu, copy_gbs, datasheet / 1e9 if datasheet else None


def uneven_benchmark(kernels: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The uneven batch alone (chapter 8's --only-uneven): bandwidths, then uneven_batch."""
    console.rule("[bold]3. Benchmark: the uneven batch")
    gpu, copy_gbs, datasheet_gbs = bandwidths(device)
    return dict(gpu=gpu, **uneven_batch(kernels, device, dtype, copy_gbs, datasheet_gbs))


def benchmark(kernels: Any, args: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Section 3 of chapter 8: the sweeps by context and by batch, the goals, the uneven batch,
    the split sweep (unless args.skip_split_sweep) and (unless args.e2e_requests is 0) the
    engine's throughput by attention backend."""
    from minivllm.course import plots
    from minivllm.course.plots.kernels import plot_bandwidth

    console.rule("[bold]3. Benchmark")
    gpu, copy_gbs, datasheet_gbs = bandwidths(device)
    layout = f"{gpu}, {str(dtype).removeprefix('torch.')}, {HEADS} q / {KV_HEADS} kv heads × {HEAD_DIM}, block {BLOCK_SIZE}"
    by_context = decode_sweep(kernels, device, dtype, [(TARGET[0], c) for c in CONTEXTS], args.skip_flex)
    fig = plot_bandwidth(CONTEXTS, by_context["seconds"], by_context["bandwidth"], copy_gbs, "context length (tokens)",
                         f"Decode attention, batch {TARGET[0]} (GPU time: CUDA graph replays)", layout)
    console.print(f"saved {plots.save(fig, '08_decode_vs_context')}")
    goal = goals(by_context, copy_gbs, datasheet_gbs, dtype)
    by_batch = decode_sweep(kernels, device, dtype, [(b, TARGET[1]) for b in BATCHES], args.skip_flex)
    fig = plot_bandwidth(BATCHES, by_batch["seconds"], by_batch["bandwidth"], copy_gbs, "batch size (sequences)",
                         f"Decode attention, {TARGET[1]:,}-token contexts (GPU time: CUDA graph replays)", layout)
    console.print(f"saved {plots.save(fig, '08_decode_vs_batch')}")
    uneven = uneven_batch(kernels, device, dtype, copy_gbs, datasheet_gbs)
    splits = None if args.skip_split_sweep else split_sweep(kernels, device, dtype, copy_gbs)
    engine = None if args.e2e_requests == 0 else engine_throughput(args, device, dtype)
    return dict(copy_bandwidth_gbs=copy_gbs, datasheet_bandwidth_gbs=datasheet_gbs, layout=layout,
                sms=kernels.sm_count(device), contexts=CONTEXTS, uneven=uneven,
                batch_for_contexts=TARGET[0], by_context=by_context, goals=goal, batches=BATCHES,
                context_for_batches=TARGET[1], by_batch=by_batch, target_fraction_of_copy=goal["of_copy_at_target"],
                split_sweep=splits, engine=engine)


