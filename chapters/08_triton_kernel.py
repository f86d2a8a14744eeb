"""Chapter 8 — paged attention in Triton: read the KV pool in place, at the speed of memory.

    python chapters/08_triton_kernel.py [--device cpu|cuda] [--e2e-requests N] [--skip-flex] [--skip-split-sweep]
                                        [--model SRC] [--only-uneven]

(--model is the engine benchmark's model; default: Qwen3-0.6B's shape with random weights.)

1. Narrate: what a decode step reads, and how the kernels split the work (figures/08_paged_tiles.png).
2. Check: the Triton kernels against chapter 6's PyTorch paged attention and a float64
   reference (on the CPU in Triton's interpreter: TRITON_INTERPRET=1 is set for you).
3. Benchmark (CUDA only): decode attention time and achieved bandwidth against context length
   (128 to 8,192 tokens at batch 64) and batch size, for the Triton kernel, the PyTorch paged
   path, padded scaled_dot_product_attention and FlexAttention, with the measured copy
   bandwidth as the ceiling (figures/08_decode_vs_context.png, 08_decode_vs_batch.png), and a
   table of the Triton kernel against SDPA and against copy bandwidth, checked against the
   goals; an uneven batch like the nano workload's decode steps (256 sequences, contexts
   uniform on 100..2,048) with the kernel unsplit, split 2, 4 and 8 ways and as decode_plan
   splits it, against masked SDPA on padded dense K/V, each as a share of copy and of datasheet
   bandwidth; a sweep of the kernel's split and tile sizes at short and long contexts; and
   end-to-end engine throughput with attention="torch" vs "triton"
   (figures/08_engine_throughput.png). Results: benchmarks/results/08_triton_kernel.json.
   --only-uneven runs the uneven batch alone (under a minute on an H200):
   benchmarks/results/08_decode_uneven.json.

   Each call is timed as the replay of a CUDA graph that holds it, as the engine's decode
   steps run (chapter 9): the GPU's time, without the host's cost of launching kernels, for
   every method alike (one that cannot be captured is timed eagerly, and the JSON says so).
   "triton, eager launches" adds that host cost back, to show what graphs remove.

Head layout: Qwen3-0.6B's (16 query heads, 8 KV heads, head_dim 128), bf16 on the GPU.
"""
from __future__ import annotations

import random
from typing import Any

import torch

from minivllm.course.bench.harness import chapter_parser, console, format_bytes
from minivllm.course.bench.kernels import (BLOCK_SIZE, H100_SMS, HEAD_DIM, HEADS, KV_HEADS, TARGET, benchmark, decode_args,
                                    make_decode_problem, one_layer_pool, reference_decode, uneven_benchmark)
from minivllm.triton_support import use_interpreter

# ------------------------------------------------------------------------------------------
# 1. Narrate
# ------------------------------------------------------------------------------------------


def narrate(kernels: Any, dtype: torch.dtype) -> None:
    from minivllm.course import plots
    from minivllm.course.plots.kernels import plot_paged_tiles

    batch, context = TARGET
    per_token = 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    step_bytes = batch * context * per_token
    console.rule("[bold]1. What decode attention reads")
    console.print(
        f"Qwen3-0.6B's layout: {HEADS} query heads share {KV_HEADS} KV heads of {HEAD_DIM} dims. One layer's K and V "
        f"take {format_bytes(per_token)} per token ({str(dtype).removeprefix('torch.')}), so a decode step at batch "
        f"{batch} × {context:,} tokens reads {format_bytes(step_bytes)} per layer. Each K/V element feeds "
        f"{HEADS // KV_HEADS} query heads: about {2 * HEADS // KV_HEADS / dtype.itemsize:.0f} FLOP per byte, far below the "
        f"~300 FLOP/byte where an H100 stops waiting for memory. Decode attention is a memory read; its speed limit "
        f"is the copy bandwidth of the GPU.")
    console.print(
        "Chapter 6's PyTorch path gathers every sequence's blocks into a padded copy and then attends to the copy: it "
        "reads the context, writes it again, and reads it back (plus scores and probabilities) — three or more passes "
        "over the bytes that matter. The Triton kernel follows the block table itself and reads each byte once.")
    block_n = kernels.decode_tiles(HEAD_DIM, dtype.itemsize)[0]
    pairs = batch * KV_HEADS
    console.print(
        f"Decode kernel grid: (sequence, KV head, partition). At batch {batch} with {KV_HEADS} KV heads there are "
        f"{pairs} (sequence, KV head) pairs, about {pairs / H100_SMS:.0f} per SM of an H100: too few programs to keep "
        f"enough loads in flight. So each context is split into P partitions, read by one program each (tiles of "
        f"{block_n} tokens, a running softmax for the {HEADS // KV_HEADS} query heads of its KV head), and a second "
        f"kernel merges each head's P partial results (the merge is the chapter's exercise: merge_partials). "
        f"P is chosen from the grid alone, so a CUDA graph can capture the launch:")
    for context in (128, 256, 1024, context):
        P = kernels.decode_plan(batch, KV_HEADS, context, block_n, H100_SMS)
        how = ("one pass: the kernel writes the output, no partials, no merge" if P == 1 else
               f"{P} partitions of {-(-context // P):,} tokens, {pairs * P:,} programs, then the merge")
        console.print(f"  batch {batch} × {context:>5,} tokens: {how}")
    table = random.Random(0).sample(range(14), 11)
    fig = plot_paged_tiles(table, context_len=83, block_size=8, num_blocks=14, block_n=16, partition_size=32)
    console.print(f"saved {plots.save(fig, '08_paged_tiles')}")


# ------------------------------------------------------------------------------------------
# 2. Check against PyTorch
# ------------------------------------------------------------------------------------------


def check(kernels: Any, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Max abs errors of the decode and prefill kernels against PyTorch and float64."""
    from minivllm.attention.paged import PagedAttention, PagedBatch, paged_decode
    from minivllm.attention.triton_paged import TritonPagedAttention

    console.rule("[bold]2. Check against PyTorch")
    on_gpu = device.type == "cuda"
    # The interpreter runs every program in Python: tiny on the CPU, realistic on the GPU.
    contexts = [1, 17, 300, 4096, 1500, 2049, 64, 777] if on_gpu else [1, 17, 300]
    problem = make_decode_problem(contexts, device, dtype)
    args = decode_args(problem)
    got, torch_out = kernels.paged_decode(*args, max(contexts)), paged_decode(*args, max(contexts))
    expected = reference_decode(problem)
    errors = dict(decode_vs_torch=(got - torch_out).abs().max().item(),
                  decode_vs_float64=(got.double() - expected).abs().max().item(),
                  torch_paged_vs_float64=(torch_out.double() - expected).abs().max().item())
    # Both of the kernel's paths: one partition (a single pass that writes the output), and a
    # grid sized as a CUDA graph sizes it, for the longest context the engine allows (Qwen3-0.6B:
    # 40,960 tokens), far beyond these contexts, so that most partitions are empty.
    single = kernels.paged_decode(*args, max(contexts), partition_size=max(contexts))
    graph_grid = kernels.paged_decode(*args, 40960 if on_gpu else 4096)
    errors["decode_single_pass_vs_float64"] = (single.double() - expected).abs().max().item()
    errors["decode_graph_grid_vs_float64"] = (graph_grid.double() - expected).abs().max().item()

    # A mixed step through both attention classes: prompt chunks after cached pasts, decodes.
    past_lens, query_lens = ([0, 700, 33, 2000], [513, 1, 200, 1]) if on_gpu else ([0, 9, 40], [21, 1, 13])
    tables, num_blocks = [], 0
    for p, q_len in zip(past_lens, query_lens):
        n = -(-(p + q_len) // BLOCK_SIZE)
        tables.append(list(range(num_blocks, num_blocks + n))[::-1])  # each sequence's blocks in reverse
        num_blocks += n
    batch = PagedBatch.build(tables, past_lens, query_lens, BLOCK_SIZE, device)
    torch_pool, triton_pool = (one_layer_pool(num_blocks, device, dtype) for _ in range(2))
    T = sum(query_lens)
    q, k, v = (torch.randn(T, h, HEAD_DIM, device=device).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    expected_step = PagedAttention(torch_pool, batch)(0, q, k, v)
    got_step = TritonPagedAttention(triton_pool, batch)(0, q, k, v)
    errors["prefill_step_vs_torch"] = (got_step - expected_step).abs().max().item()
    errors["store_kv_vs_torch"] = max((triton_pool.k - torch_pool.k).abs().max().item(),
                                      (triton_pool.v - torch_pool.v).abs().max().item())

    tolerance = 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    for name, error in errors.items():
        console.print(f"  {name:<30} max |error| = {error:.2e}")
    bad = {n: e for n, e in errors.items() if e > tolerance and n != "torch_paged_vs_float64"}
    if bad:
        raise SystemExit(f"the Triton kernels disagree with PyTorch beyond {tolerance}: {bad}; not benchmarking")
    console.print(f"[green]kernels agree with PyTorch (tolerance {tolerance})")
    return errors


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--e2e-requests", type=int, default=128, help="requests of the engine benchmark (0: skip it)")
    parser.add_argument("--skip-flex", action="store_true", help="leave FlexAttention out (its compiles take time)")
    parser.add_argument("--skip-split-sweep", action="store_true",
                        help="leave out the sweep of splits and tiles (hundreds of compiles: minutes on a GPU)")
    parser.add_argument("--only-uneven", action="store_true",
                        help="only the uneven batch (nano-like decode step) benchmark: CUDA only, under a minute")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.only_uneven and device.type != "cuda":
        parser.error("--only-uneven times kernels: it needs --device cuda")
    if device.type == "cpu":
        use_interpreter()  # before anything imports Triton: it decides when its own library is defined
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if device.type == "cpu" and dtype == torch.bfloat16:
        parser.error("Triton's interpreter computes bfloat16 matmuls wrongly; use --dtype float32 on the CPU")
    from minivllm.attention import triton_kernels as kernels
    from minivllm.course.bench.harness import save_results
    from minivllm.machine import environment

    if args.only_uneven:
        results = uneven_benchmark(kernels, device, dtype)
        path = save_results("08_decode_uneven", dict(environment=environment() | dict(device=results["gpu"]),
                                                     dtype=str(dtype), **results))
        console.print(f"saved {path}")
        return
    narrate(kernels, dtype)
    errors = check(kernels, device, dtype)
    if device.type != "cuda":
        console.rule("[bold]3. Benchmark")
        console.print("[yellow]The timing part needs CUDA: the interpreter shows the kernels are right, not fast. "
                      "Run `python chapters/08_triton_kernel.py --device cuda` on a GPU.")
        path = save_results("08_triton_kernel_cpu_check", dict(environment=environment(), device="cpu (interpreter)",
                                                                dtype=str(dtype), errors=errors))
        console.print(f"saved {path}")
        return
    results = benchmark(kernels, args, device, dtype)
    path = save_results("08_triton_kernel", dict(environment=environment() | dict(device=torch.cuda.get_device_name(device)),
                                                 dtype=str(dtype), errors=errors, **results))
    console.print(f"saved {path}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
