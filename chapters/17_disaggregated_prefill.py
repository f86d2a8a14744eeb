"""Chapter 17 — disaggregated prefill: the prompt's K/V computed in one instance, decoded in another.

    python chapters/17_disaggregated_prefill.py [--lengths 64,256,480] [--repeats 5] [--model SRC] [--device cpu|cuda]

- runs one request through a producer (kv_producer, max_tokens=1) and then a consumer
  (kv_consumer) sharing a folder (SharedStorageConnector), and prints every connector call in
  the order the engines make them, on both sides of each instance;
- checks that the consumer's greedy tokens are one engine's, and lists the block files the
  producer wrote (each named by the prompt prefix it ends);
- measures, for prompts of --lengths tokens, the consumer's time to first token when it loads
  the prompt's blocks from the files against computing them itself (one engine), and the bytes
  that travel per prompt.
JSON: benchmarks/results/17_disaggregated_prefill_<device>.json.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
from rich.table import Table

from minivllm import LLM, SamplingParams, load_tokenizer
from minivllm.course.bench.disagg import load_or_compute, record_calls, transfer_config
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.course.text import DEMO_PROMPT, random_prompts, show_sample
from minivllm.machine import environment

def one_request(model, tokenizer, folder: str) -> dict:
    """The connector's calls for one request through a producer, then a consumer."""
    vocab = model.config.vocab_size  # the demo prompt four times: three full blocks of 16, and a few tokens
    prompt = tokenizer.encode(DEMO_PROMPT * 4) if tokenizer is not None else random_prompts([52], vocab)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    log: list[str] = []
    settings = dict(tokenizer=tokenizer, block_size=16, max_model_len=min(512, model.config.max_position_embeddings),
                    enable_prefix_caching=False)
    producer = LLM(model, kv_transfer_config=transfer_config("kv_producer", folder), **settings)
    record_calls(producer, "producer", log)
    producer.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    consumer = LLM(model, kv_transfer_config=transfer_config("kv_consumer", folder), **settings)
    record_calls(consumer, "consumer", log)
    out = consumer.generate([prompt], greedy, use_tqdm=False)[0]
    alone = LLM(model, **settings).generate([prompt], greedy, use_tqdm=False)[0]
    console.print(f"[bold]One request of {len(prompt)} tokens[/], blocks of 16: the connector's calls in order "
                  "(per-layer calls for layer 0 only; decode steps, which move nothing, left out)")
    for line in log:
        console.print("  " + line)
    files = sorted(Path(folder).rglob("*.safetensors"))
    console.print(f"the producer wrote {len(files)} block files under {files[0].parent}:" if files else "no files")
    for path in files[:3]:
        console.print(f"  {path.name[:16]}…  ({path.stat().st_size:,} bytes)")
    show_sample(tokenizer, prompt, out.outputs[0].token_ids, "the consumer's answer")
    same = out.outputs[0].token_ids == alone.outputs[0].token_ids
    console.print(f"the consumer loaded {out.num_cached_tokens} of {len(prompt)} prompt tokens and gives one "
                  f"engine's tokens: {'✓' if same else '✗'}")
    return dict(prompt_tokens=len(prompt), loaded_tokens=out.num_cached_tokens, same_tokens=same, calls=log,
                files=len(files))


def timing_table(model, lengths: list[int], repeats: int, folder: str) -> list[dict]:
    """load_or_compute's rows, printed as a table."""
    rows = load_or_compute(model, lengths, repeats, folder)
    load = os.getloadavg()[0]
    table = Table(title=f"Time to first token, one prompt (median of {repeats}; {torch.get_num_threads()} threads, "
                        f"load average {load:.1f})")
    for column in ("prompt tokens", "computed: wall ms", "CPU ms", "loaded: wall ms", "CPU ms", "K/V moved"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["prompt_tokens"]), f"{r['compute_ms']:.1f}", f"{r['compute_cpu_ms']:.1f}",
                      f"{r['load_ms']:.1f}", f"{r['load_cpu_ms']:.1f}", f"{r['transfer_bytes'] / 2**20:.2f} MiB")
    console.print(table)
    return rows


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,256,480", help="prompt lengths to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="prompts per length (the median counts)")
    args = parser.parse_args()
    try:
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: comma-separated integers, got {args.lengths!r}")
    if any(n < 2 for n in args.lengths) or args.repeats < 1:
        parser.error("--lengths must all be at least 2 and --repeats at least 1")
    start = time.perf_counter()
    model = load_for_chapter(args)
    if max(args.lengths) + 16 > model.config.max_position_embeddings:
        parser.error(f"--lengths: at most {model.config.max_position_embeddings - 16} for this model")
    tokenizer = load_tokenizer(args.model)
    with tempfile.TemporaryDirectory() as demo, tempfile.TemporaryDirectory() as timed:
        facts = dict(one_request=one_request(model, tokenizer, demo),
                     load_or_compute=timing_table(model, args.lengths, args.repeats, timed))
    path = save_results(f"17_disaggregated_prefill_{model.device.type}", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"),
        threads=torch.get_num_threads(), load_average=list(os.getloadavg()), seconds=time.perf_counter() - start,
        **facts))
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
