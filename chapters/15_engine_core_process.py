"""Chapter 15: the engine core in its own process.

Chapter 10's server runs the engine in a thread beside the HTTP event loop: one process, one
GIL, so every step the model waits while Python writes JSON for 128 streams, and the streams
wait while the model runs. This chapter splits the engine into an input processor, a core and
an output processor, and runs the core in a process of its own (ZMQ + msgspec): the core does
nothing but schedule -> run -> sample and sends each step's new token ids; the frontend does
HTTP, text and SSE meanwhile.

This script: a sample through the split engine, then the measurement of minivllm/course/bench/
split_serving.py (both servers as `minivllm serve` processes, the load generator as a
`minivllm bench-serve` process, the engine offline on the same requests). It writes, under
--out (default runs/, so the committed files the notebook reads stay as they are),
benchmarks/results/15_core_process_cpu.json, figures/15_latency_vs_users.png and the picture
of the split, figures/15_core_process.png.

    python chapters/15_engine_core_process.py                 # 1, 8, 32, 128 users (about a minute)
    python chapters/15_engine_core_process.py --users 1,8     # a quick look
    python chapters/15_engine_core_process.py --out .         # refresh the committed files
"""
from __future__ import annotations

import argparse

import msgspec
from rich.console import Console
from rich.table import Table

from minivllm import LLMEngine, SamplingParams
from minivllm.course import plots
from minivllm.course.bench.harness import add_output_argument, enter_output_folder
from minivllm.course.bench.split_serving import USERS, measure
from minivllm.course.plots.process import plot_core_process

console = Console()


def sample() -> int:
    """One request through the three pieces, step by step: what the core sends, what the user
    reads. Returns the bytes of a step's message for one request (msgspec's msgpack)."""
    engine = LLMEngine()
    sizes = []
    engine.add_request(request_id="demo", prompt="def fibonacci(n):", params=SamplingParams(max_tokens=6, temperature=0))
    while engine.has_unfinished_requests():
        news = engine.core.step()
        outputs, _ = engine.output_processor.process_outputs(news)
        sizes.append(len(msgspec.msgpack.encode(news)))
        for out, shown in zip(news, outputs):
            console.print(f"core sends {out.new_token_ids} (finish: {out.finish_reason})  ->  the user reads "
                          f"{shown.outputs[0].text!r}  ({sizes[-1]} bytes on the wire)")
    return sizes[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default=",".join(map(str, USERS)), help="concurrent users per level")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of each engine")
    add_output_argument(parser)
    args = parser.parse_args()
    enter_output_folder(args)
    step_bytes = sample()
    console.print(f"saved {plots.save(plot_core_process(step_bytes), '15_core_process')}")
    summary = measure([int(u) for u in args.users.split(",")], threads=args.threads)
    offline = summary["offline"]
    table = Table(title=f"served output tok/s at each level; offline {offline['output_throughput']:,.0f} tok/s on the "
                        f"{max(map(int, args.users.split(',')))}-user requests, step p50 "
                        f"{(offline['step_seconds_p50_full_batch'] or 0) * 1e3:.1f} ms")
    for column in ("server", "users", "output tok/s", "ITL p50 ms", "ITL p50 / offline step", "TTFT p99 ms", "load avg"):
        table.add_column(column, justify="right")
    for label, server in summary["servers"].items():
        for lv in server["levels"]:
            table.add_row(label, str(lv["users"]), f"{lv['output_throughput']:,.0f}",
                          f"{(lv['itl_p50'] or 0) * 1e3:.1f}", f"{lv['itl_p50_over_offline_step'] or 0:.2f}",
                          f"{(lv['ttft_p99'] or 0) * 1e3:,.0f}", f"{lv['load_average']:.1f}")
    console.print(table)
    for label, server in summary["servers"].items():
        console.print(f"{label}: served / offline at the most users = {server['fraction_of_offline_at_max_users']:.2f}")


if __name__ == "__main__":
    main()
