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

import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rich.table import Table

from minivllm import LLM, SamplingParams, load_tokenizer
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.course.text import DEMO_PROMPT, random_prompts, show_sample
from minivllm.kv_transfer.base import KVConnectorMetadata
from minivllm.machine import environment

CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
         "bind_connector_metadata", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")


def describe(value) -> str:
    """A call's argument or result, short: a request by id, a step's plan by its sizes."""
    if isinstance(value, KVConnectorMetadata):
        return f"meta(loads={len(value.loads)} blocks, saves={len(value.saves)} blocks)"
    if hasattr(value, "request_id"):
        return f"request {value.request_id!r}"
    if hasattr(value, "num_new_tokens"):
        return f"schedule({dict(zip([s.request_id for s in value.seqs], value.num_new_tokens))})"
    if hasattr(value, "k") and hasattr(value, "num_blocks"):
        return "pool"
    return repr(value)


def record_calls(llm: LLM, name: str, log: list[str]) -> None:
    """Wrap the connector methods of both halves of llm's connector so that each call is logged.
    Per-layer calls are logged for layer 0 only (the others repeat it), and steps that move
    nothing (a decode: build_connector_meta's plan is empty) not at all."""
    core = llm.engine.core
    for side, connector in (("scheduler", core.connector), ("worker", core.runner.connector)):
        for method in CALLS:
            original = getattr(connector, method)

            @functools.wraps(original)
            def logged(*args, _original=original, _method=method, _side=side, _connector=connector):
                result = _original(*args)
                plan = {"build_connector_meta": result, "bind_connector_metadata": args[0] if args else None}.get(
                    _method, _connector._meta if _side == "worker" else None)
                idle = plan is not None and not plan.loads and not plan.saves
                if not idle and not (_method in ("wait_for_layer_load", "save_kv_layer") and args[0] != 0):
                    shown = ", ".join(map(describe, args))
                    suffix = f" -> {describe(result)}" if result is not None else ""
                    log.append(f"{name:9} {_side:9} {_method}({shown}){suffix}")
                return result
            setattr(connector, method, logged)


def transfer_config(role: str, folder: str) -> dict:
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": folder}}


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


def first_token_seconds(llm: LLM, prompt: list[int]) -> tuple[float, float]:
    """Wall and CPU seconds (every thread of this process) to generate one token for one prompt:
    its prefill, or its load and the last token. On a shared machine the CPU time is the steadier."""
    wall, cpu = time.perf_counter(), time.process_time()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def load_or_compute(model, lengths: list[int], repeats: int, folder: str) -> list[dict]:
    """Time to first token of one prompt: computed by one engine, or loaded by a consumer from
    the files a producer wrote (medians of `repeats`, each on fresh prompts: no prefix cache helps)."""
    settings = dict(block_size=16, max_model_len=max(lengths) + 16, enable_prefix_caching=False,
                    max_num_batched_tokens=max(lengths))
    alone = LLM(model, **settings)
    producer = LLM(model, kv_transfer_config=transfer_config("kv_producer", folder), **settings)
    consumer = LLM(model, kv_transfer_config=transfer_config("kv_consumer", folder), **settings)
    bytes_per_token = model.config.kv_bytes_per_token(model.dtype)
    warm = random_prompts([min(lengths)], model.config.vocab_size, seed=1)[0]
    for llm in (alone, producer, consumer):  # first calls pay one-time costs: not what is measured
        first_token_seconds(llm, warm)
    rows = []
    for length in lengths:
        prompts = random_prompts([length] * repeats, model.config.vocab_size, seed=length)
        computed = [first_token_seconds(alone, p) for p in prompts]
        for p in prompts:
            producer.generate([p], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        loaded = [first_token_seconds(consumer, p) for p in prompts]
        moved = (length - 1) // 16 * 16
        rows.append(dict(prompt_tokens=length, loaded_tokens=moved, transfer_bytes=moved * bytes_per_token,
                         compute_ms=1e3 * statistics.median(w for w, _ in computed),
                         load_ms=1e3 * statistics.median(w for w, _ in loaded),
                         compute_cpu_ms=1e3 * statistics.median(c for _, c in computed),
                         load_cpu_ms=1e3 * statistics.median(c for _, c in loaded)))
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
                     load_or_compute=load_or_compute(model, args.lengths, args.repeats, timed))
    path = save_results(f"17_disaggregated_prefill_{model.device.type}", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"),
        threads=torch.get_num_threads(), load_average=list(os.getloadavg()), seconds=time.perf_counter() - start,
        **facts))
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
