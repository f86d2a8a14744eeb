"""Chapter 17 — disaggregated prefill: the prompt's K/V computed in one instance, decoded in another.

    python chapters/17_disaggregated_prefill.py [--lengths 64,256,480] [--repeats 5] [--model SRC] [--device cpu|cuda]
    python chapters/17_disaggregated_prefill.py --itl [--rounds 3] [--model CONFIG --device cuda]

- runs one request through a producer (kv_producer, max_tokens=1) and then a consumer
  (kv_consumer) sharing a folder (SharedStorageConnector), and prints every connector call in
  the order the engines make them, on both sides of each instance;
- checks that the consumer's greedy tokens are one engine's, and lists the block files the
  producer wrote (each named by the prompt prefix it ends);
- measures, for prompts of --lengths tokens, the consumer's time to first token when it loads
  the prompt's blocks from the files against computing them itself (one engine), and the bytes
  that travel per prompt.

With --itl, instead, the lesson online (course/bench/disagg_serving.py, a few minutes): decode
streams' inter-token latency and TTFT while long prompts keep arriving, served by one engine or
by a prefill and a decode instance behind `minivllm disagg-proxy` (their blocks crossing through
files, or over ZMQ), in turns for --rounds rounds. On a CPU: `minivllm serve` processes of one
torch thread on the cheap 2-layer model; figure figures/17_itl_over_time.png. On a GPU
(--device cuda): all five processes on the one GPU, on --model (a real shape, e.g.
minivllm/configs/qwen3-0.6b.json: random weights, the same in every process) under a heavier
workload (ITL_WORKLOADS); figure figures/17_itl_over_time_cuda.png.
JSON: benchmarks/results/17_disaggregated_prefill_<device>.json; each mode replaces only its own
sections (--itl: "itl_under_long_prompts") and keeps the other's.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from minivllm import LLM, SamplingParams, load_tokenizer
from minivllm.course.bench import disagg_serving
from minivllm.course.bench.disagg import load_or_compute, record_calls, transfer_config
from minivllm.course.bench.harness import (
    RESULTS_DIR,
    chapter_parser,
    console,
    load_for_chapter,
    save_results,
)
from minivllm.course.bench.split_serving import CHEAP_SHAPE, ENGINE, write_cheap_model
from minivllm.course.plots import save
from minivllm.course.plots.disagg import plot_itl_over_time
from minivllm.course.text import DEMO_PROMPT, random_prompts, show_sample
from minivllm.machine import environment


def one_request(model, tokenizer, folder: str) -> dict:
    """The connector's calls for one request through a producer, then a consumer."""
    vocab = model.config.vocab_size  # the demo prompt four times: three full blocks of 16, and a few tokens
    prompt = tokenizer.encode(DEMO_PROMPT * 4) if tokenizer is not None else random_prompts([52], vocab)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    log: list[str] = []
    settings = {"tokenizer": tokenizer, "block_size": 16,
                "max_model_len": min(512, model.config.max_position_embeddings), "enable_prefix_caching": False}
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
    return {"prompt_tokens": len(prompt), "loaded_tokens": out.num_cached_tokens, "same_tokens": same, "calls": log,
            "files": len(files)}


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


# The --itl workload per device: on a GPU a step costs milliseconds whatever the model, so the
# streams are more, longer, and the long prompts longer and closer together.
ITL_WORKLOADS = {
    "cpu": {"streams": 8, "stream_prompt": 32, "stream_tokens": 128, "long_prompts": 30, "long_prompt": 480,
            "long_tokens": 8, "interval": 0.3, "first_long": 0.3},
    "cuda": {"streams": 32, "stream_prompt": 32, "stream_tokens": 256, "long_prompts": 60, "long_prompt": 1920,
             "long_tokens": 8, "interval": 0.05, "first_long": 0.1},
}


def itl_under_long_prompts(rounds: int, device: str, dtype: str | None, source: str | None) -> dict[str, Any]:
    """The --itl section: disagg_serving.measure on `source` (a checkpoint folder or a bare
    config.json; None: the cheap model), its table and figure."""
    workload = ITL_WORKLOADS[device]
    with tempfile.TemporaryDirectory(prefix="minivllm-cheap-") as folder:
        model = write_cheap_model(Path(folder)) if source is None else Path(source)
        config = json.loads((model if model.is_file() else model / "config.json").read_text())
        load = list(os.getloadavg())
        result = disagg_serving.measure(model, config["vocab_size"], rounds, progress=console.print, device=device,
                                        dtype=dtype, **workload)
    table = Table(title=f"Decode streams while a {workload['long_prompt']}-token prompt arrives every "
                        f"{workload['interval']:g} s (ms, median of {rounds} rounds; {device}; load average "
                        f"{load[0]:.1f}; long prompts and failures: all rounds)")
    for column in ("setup", "stream ITL p50", "p99", "stream TTFT p50", "p99", "long prompt TTFT p50", "p99",
                   "long prompts", "failed"):
        table.add_column(column, justify="left" if column == "setup" else "right")
    for name, setup in result["setups"].items():
        m = setup["medians"]
        table.add_row(name, *(f"{m[key][p]:.1f}" if key in m else "-" for key in
                               ("stream_itl_ms", "stream_ttft_ms", "long_ttft_ms") for p in ("p50", "p99")),
                      str(sum(r["long_prompts_sent"] for r in setup["rounds"])),
                      str(sum(r["failed"] for r in setup["rounds"])))
    console.print(table)
    console.print(f"the producer wrote {result['block_files']} block files for the "
                  f"{result['expected_block_files']} full blocks of the prompts it was sent; prompts with blocks "
                  f"not saved: {result['prompts_with_unsaved_blocks']}; failed in the warm-up: "
                  f"{result['warm_up_failed']}")
    what = "cheap model, CPU" if source is None else f"{Path(source).stem}, {device}"
    figure = plot_itl_over_time({name: s["median_round"] for name, s in result["setups"].items()},
                                f"Decode streams' inter-token gaps, a {workload['long_prompt']}-token prompt every "
                                f"{workload['interval']:g} s ({what}, the median round)")
    console.print(f"saved {save(figure, '17_itl_over_time' + ('' if device == 'cpu' else f'_{device}'))}")
    shape = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads", "head_dim", "vocab_size") if k in config}
    model_facts = ({"shape": CHEAP_SHAPE, "tokenizer": "the embedded model's", "weights": "random (seed 0)"}
                   if source is None else {"source": str(source), "shape": shape,
                                           "weights": "random" if Path(source).is_file() else "the checkpoint's"})
    return dict(environment=environment(), device=device, dtype=dtype or ("float32" if device == "cpu" else "bfloat16"),
                threads_per_instance=1 if device == "cpu" else torch.get_num_threads(), model=model_facts,
                engine=ENGINE | {"block_size": disagg_serving.BLOCK_SIZE, "enable_prefix_caching": False},
                workload=workload, rounds=rounds, created=time.strftime("%Y-%m-%d %H:%M:%S"),
                load_average_at_start=load, load_average_at_end=list(os.getloadavg()),
                command="python chapters/17_disaggregated_prefill.py --itl " + " ".join(
                    [f"--rounds {rounds}", f"--device {device}", *([f"--model {source}"] if source else []),
                     *([f"--dtype {dtype}"] if dtype else [])]), **result)


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,256,480", help="prompt lengths to time, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="prompts per length (the median counts)")
    parser.add_argument("--itl", action="store_true", help="only the online ITL measurement (three setups of servers)")
    parser.add_argument("--rounds", type=int, default=3, help="--itl: rounds of every setup (the median counts)")
    args = parser.parse_args()
    if args.itl:
        if args.rounds < 1:
            parser.error("--rounds must be at least 1")
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if args.model is not None and not Path(args.model).exists():
            parser.error(f"--itl: --model must be a checkpoint folder or a config.json here, got {args.model!r}")
        start = time.perf_counter()
        name = f"17_disaggregated_prefill_{device}"
        path = save_results(name, kept_sections(name) | {
            "itl_under_long_prompts": itl_under_long_prompts(args.rounds, device, args.dtype, args.model)})
        console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")
        return
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
        facts = {"one_request": one_request(model, tokenizer, demo),
                 "load_or_compute": timing_table(model, args.lengths, args.repeats, timed)}
    name = f"17_disaggregated_prefill_{model.device.type}"
    kept = {k: v for k, v in kept_sections(name).items() if k == "itl_under_long_prompts"}
    path = save_results(name, kept | dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"),
        threads=torch.get_num_threads(), load_average=list(os.getloadavg()), seconds=time.perf_counter() - start,
        **facts))
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


def kept_sections(name: str) -> dict[str, Any]:
    """What benchmarks/results/<name>.json holds already (empty if nothing)."""
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


if __name__ == "__main__":
    main()
