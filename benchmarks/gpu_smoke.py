"""Chapter 9's engine against the eager one, token for token, before anything is timed.

    python benchmarks/gpu_smoke.py [--device cuda] [--model minivllm/configs/qwen3-0.6b.json] [--requests 8]
                                   [--max-tokens 48]

The default engine on a GPU replays decode steps from CUDA graphs and steps that carry prompt
tokens from graphs cut at attention (piecewise_graphs.py), runs the token-wise work as fused
Triton kernels and attends with Triton; `cuda_graphs=False, fused_ops=False` is chapter 8's
eager engine with the same attention. Both run the same greedy requests (random prompts of
16 to 400 tokens, or as many as the model's context leaves, EOS ignored):

- in float32 they must give identical tokens: graphs and fused kernels change how the work is
  launched, not what is computed (the fused kernels round where model.py rounds, fp32 matmuls
  stay fp32);
- in bfloat16 they may legitimately drift apart: merged q/k/v and gate/up projections are
  different matrix products, whose sums are rounded to 8 bits of mantissa in a different order,
  and with random weights near-ties between the top two logits are common, so one flipped
  argmax changes the rest of a request. The agreement rate (identical requests, and the share
  of tokens before the first difference) is reported, not required.

Also reported: how long each engine took to build (KV pool and, with graphs, their capture).
On a CPU (a dry run of the same code) both engines are eager. Results:
benchmarks/results/gpu_smoke_<device>.json; the exit status is 1 if the float32 tokens differ.
"""
from __future__ import annotations

import gc
import random
import time
from typing import Any

import torch

from minivllm import LLM, SamplingParams
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.machine import environment, synchronize

ENGINES = {"default (graphs + pieces + fused + Triton on a GPU)": {}, "eager (cuda_graphs=False, fused_ops=False)":
           dict(cuda_graphs=False, fused_ops=False)}


def prompts_for(vocab_size: int, n: int, seed: int, longest: int) -> list[list[int]]:
    """n random prompts of 16 to `longest` tokens (at most 400)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(min(16, longest), min(400, longest)))]
            for _ in range(n)]


def run_engines(model: Any, prompts: list[list[int]], max_tokens: int, num_kv_blocks: int) -> dict[str, Any]:
    """Each engine's tokens for the prompts, and how long it took to build."""
    results = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for name, options in ENGINES.items():
        synchronize(model.device)
        start = time.perf_counter()
        llm = LLM(model, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False, **options)
        synchronize(model.device)
        built = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        results[name] = dict(build_seconds=built, settings={k: getattr(llm.engine.config, k) for k in
                                                            ("attention", "cuda_graphs", "piecewise_graphs",
                                                                               "fused_ops", "async_scheduling")}, tokens=tokens)
        del llm
        gc.collect()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Identical requests, and the tokens before the first difference, over all requests."""
    prefix = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b))
    return dict(identical_requests=sum(p == q for p, q in zip(a, b)), requests=len(a),
                tokens_before_first_difference=prefix / sum(map(len, a)))


def main() -> int:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-kv-blocks", type=int, default=2048, help="KV blocks of each engine")
    args = parser.parse_args()
    for name in ("requests", "max_tokens", "num_kv_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.dtype:
        parser.error("--dtype: the smoke test runs float32 and then bfloat16 itself")
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        args.dtype = str(dtype).removeprefix("torch.")
        model = load_for_chapter(args)
        prompts = prompts_for(model.config.vocab_size, args.requests, args.seed,
                              model.config.max_position_embeddings - args.max_tokens)
        results = run_engines(model, prompts, args.max_tokens, args.num_kv_blocks)
        default, eager = (r["tokens"] for r in results.values())
        runs[args.dtype] = dict(environment=environment(model), engines=results, agreement=agreement(default, eager))
        same = runs[args.dtype]["agreement"]
        console.print(f"[bold]{args.dtype}[/]: {same['identical_requests']}/{same['requests']} requests identical, "
                      f"{same['tokens_before_first_difference']:.1%} of tokens before the first difference; engines "
                      "built in " + ", ".join(f"{r['build_seconds']:.1f} s ({name})" for name, r in results.items()))
        del model
        gc.collect()
    fp32 = runs["float32"]["agreement"]
    ok = fp32["identical_requests"] == fp32["requests"]
    console.print("[green]float32: identical tokens[/]" if ok else "[red]float32: the engines disagree[/]")
    console.print("bfloat16 may differ legitimately (merged projections round in a different order; random weights "
                  "make near-ties common): its agreement is information, not a check.")
    device = runs["float32"]["environment"]["device"]
    path = save_results(f"gpu_smoke_{'cpu' if device.startswith('cpu') else 'cuda'}", dict(
        created=time.strftime("%Y-%m-%d %H:%M:%S"), model=args.model, requests=args.requests,
        max_tokens=args.max_tokens, float32_identical=ok, runs=runs))
    console.print(f"saved {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
