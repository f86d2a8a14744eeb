"""The first token under a burst: 128 users arrive at once, and the scheduler's budget decides
when each one's prompt is done (issue 48).

    python benchmarks/burst_ttft.py [--users 128] [--rounds 3]
    python benchmarks/burst_ttft.py --plot-only     # the figure again, from the results file

The engine alone (LLM.generate, every request added at time 0, greedy, EOS ignored), on the
cheap 2-layer model of chapter 15 (course/bench/split_serving.py), whose CPU step costs a few
milliseconds as a GPU's does: prompts uniform 16-480 tokens (~32k in all, near the issue's
H200 burst of ~35k; the cheap model's context is 512), 16 output tokens each. TTFT is each request's first token time minus its arrival, from
its RequestMetrics. Settings, measured in turns, round by round (the machine is shared):
- budget 2,048 (this CPU's default and, before issue 48, every device's);
- budget 8,192 (the default now on a GPU with >= 70 GiB, config/engine.py);
- budget 2,048 with long_prefill_token_threshold 128 (a prompt gets at most 128 tokens per step).
Writes benchmarks/results/48_burst_ttft_cpu.json (every request's TTFT, medians over rounds of
each setting's p50/p99) and figures/48_burst_ttft.png (course/plots/burst.py).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from minivllm import LLM, SamplingParams
from minivllm.course.bench.harness import RESULTS_DIR, save_results
from minivllm.course.bench.split_serving import CHEAP_SHAPE, write_cheap_model
from minivllm.course.plots import save
from minivllm.course.plots.burst import plot_burst_ttft
from minivllm.machine import environment

SETTINGS = {"budget 2048": {"max_num_batched_tokens": 2048},
            "budget 8192": {"max_num_batched_tokens": 8192},
            "budget 2048, cap 128": {"max_num_batched_tokens": 2048, "long_prefill_token_threshold": 128}}
OUTPUT_TOKENS = 16
RESULTS = "48_burst_ttft_cpu"
FIGURE = "48_burst_ttft"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def burst(model: Path, prompts: list[list[int]], settings: dict[str, Any]) -> dict[str, Any]:
    llm = LLM(str(model), max_num_seqs=len(prompts), num_kv_blocks=4096, **settings)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # first-call costs
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "seconds": seconds,
            "ttft": sorted(round(t, 6) for t in ttft),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "tokens": [o.outputs[0].token_ids for o in outputs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-only", action="store_true", help="only draw the figure from the results file")
    args = parser.parse_args()
    if args.plot_only:
        results = json.loads((RESULTS_DIR / f"{RESULTS}.json").read_text())
        print(save(plot_burst_ttft(results), FIGURE))
        return
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="minivllm-cheap-"))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    try:
        model = write_cheap_model(folder / "model")
        vocab = json.loads((folder / "model" / "config.json").read_text())["vocab_size"]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 480))] for _ in range(args.users)]
        for round_ in range(args.rounds):
            for name in (list(SETTINGS) if round_ % 2 == 0 else list(SETTINGS)[::-1]):
                run = burst(model, prompts, SETTINGS[name])
                runs[name].append(run)
                print(f"round {round_} {name}: TTFT p50 {1e3 * run['ttft_p50']:.0f} ms, p99 {1e3 * run['ttft_p99']:.0f} ms")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    reference = runs["budget 2048"][0]["tokens"]
    same = {name: all(r["tokens"] == reference for r in rs) for name, rs in runs.items()}
    for rs in runs.values():
        for r in rs:
            del r["tokens"]
    medians = {name: {key: statistics.median(r[key] for r in rs) for key in ("ttft_p50", "ttft_p99", "seconds")}
               for name, rs in runs.items()}
    for name, m in medians.items():
        print(f"{name}: median TTFT p50 {1e3 * m['ttft_p50']:.0f} ms, p99 {1e3 * m['ttft_p99']:.0f} ms, "
              f"{m['seconds']:.2f} s, tokens equal to budget 2048's: {same[name]}")
    results = {
        "machine": environment(), "model": {"shape": CHEAP_SHAPE, "tokenizer": "the embedded model's"},
        "users": args.users, "prompt_tokens": sum(map(len, prompts)), "output_tokens_each": OUTPUT_TOKENS,
        "settings": SETTINGS, "medians": medians, "same_tokens_as_budget_2048": same, "runs": runs,
        "command": "python benchmarks/burst_ttft.py " + f"--users {args.users} --rounds {args.rounds}"}
    save_results(RESULTS, results)
    print(save(plot_burst_ttft(results), FIGURE))


if __name__ == "__main__":
    main()
