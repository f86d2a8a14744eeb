"""Chapter 14 — copies or splits? The same requests served by one engine, by two copies of it
(data_parallel_size=2: two core processes, offline and behind the server's frontend) and by two
halves of it (tensor_parallel_size=2: two ranks), in one run, every layout given the same CPU
threads in total.

    python -m minivllm.course.bench.data_parallel [--requests 32 --prompt-len 32 --output-len 32]

Every layout must produce the same greedy tokens. Writes benchmarks/results/14_copies_or_splits_cpu.json
and figures/14_copies_or_splits_cpu.png.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minivllm.config.engine import EngineConfig
from minivllm.course.plots import save
from minivllm.course.plots.parallel import plot_copies_or_splits
from minivllm.course.text import random_prompts
from minivllm.engine.async_llm import AsyncLLM
from minivllm.entrypoints.llm import LLM
from minivllm.loader import load_model
from minivllm.request.sampling_params import SamplingParams

# A random model big enough that a step is mostly matrix work (~25M parameters, fp32).
SHAPE = dict(model_type="qwen3", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
             tie_word_embeddings=True)


def offline(source: str, prompts: list[list[int]], params: SamplingParams, threads: int, **settings: Any) -> tuple:
    """The offline LLM (one engine, tensor_parallel_size ranks, or data_parallel_size copies that
    share `threads`): (seconds, token ids per request)."""
    torch.set_num_threads(threads)
    llm = LLM(source, device="cpu", **settings)
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]
    finally:
        if settings.get("tensor_parallel_size", 1) > 1:
            llm.engine.core.runner.shutdown()
        llm.shutdown()


async def _served(source: str, config: EngineConfig, prompts: list[list[int]], params: SamplingParams,
                  threads: int) -> tuple:
    frontend = AsyncLLM(source, config, None, "cpu", None, threads=threads)
    await frontend.start()

    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for output in await frontend.add(f"r{i}", prompt, params):
            final = output
        return final.outputs[0].token_ids

    try:
        await asyncio.gather(*(one(-1 - i, p) for i, p in enumerate(prompts[:2])))  # warm-up
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - start, list(tokens)
    finally:
        frontend.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in total, for every layout")
    parser.add_argument("--out", default="benchmarks/results/14_copies_or_splits_cpu.json")
    parser.add_argument("--figures", default="figures")
    args = parser.parse_args()
    total = args.threads
    with tempfile.TemporaryDirectory() as folder:
        source = str(Path(folder) / "config.json")
        Path(source).write_text(json.dumps(SHAPE))
        cfg = load_model(source, "cpu").config
        prompts = random_prompts([args.prompt_len] * args.requests, cfg.vocab_size, 0)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        settings = dict(num_kv_blocks=512, max_num_seqs=args.requests, enable_prefix_caching=False)
        config = EngineConfig(**settings)
        runs = [
            ("one engine (offline)", 1, total, lambda: offline(source, prompts, params, total, **settings)),
            ("copies: LLM(data_parallel_size=2)", 2, total // 2,
             lambda: offline(source, prompts, params, total, data_parallel_size=2, **settings)),
            ("splits: tensor_parallel_size=2", 2, total // 2,
             lambda: offline(source, prompts, params, total // 2, tensor_parallel_size=2, **settings)),
            ("one core process", 1, total, lambda: asyncio.run(_served(source, config, prompts, params, total))),
            ("copies: serve --data-parallel-size 2", 2, total // 2, lambda: asyncio.run(_served(
                source, dataclasses.replace(config, data_parallel_size=2), prompts, params, total // 2))),
        ]
        rows, reference = [], None
        for layout, processes, threads, run in runs:
            seconds, tokens = run()
            reference = reference or tokens
            rows.append(dict(layout=layout, processes=processes, threads_each=threads, seconds=seconds,
                             output_tokens_per_s=args.requests * args.output_len / seconds,
                             same_tokens=tokens == reference, loadavg=os.getloadavg()))
            print(f"{layout:34s} {rows[-1]['output_tokens_per_s']:8.0f} output tok/s  same tokens: "
                  f"{rows[-1]['same_tokens']}  load {rows[-1]['loadavg'][0]:.1f}")
    result = dict(device="cpu", dtype="float32", model_shape=SHAPE, cpu_count=os.cpu_count(),
                  workload=f"{args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output tokens), "
                           "greedy", command="python -m minivllm.course.bench.data_parallel", rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    load = rows[0]["loadavg"][0]
    fig = plot_copies_or_splits(rows, f"copies or splits? {result['workload']}\nCPU, {args.threads} threads in all, "
                                      f"load average {load:.1f} at the start")
    print(f"wrote {args.out} and {save(fig, '14_copies_or_splits_cpu', args.figures)}")


if __name__ == "__main__":
    main()
