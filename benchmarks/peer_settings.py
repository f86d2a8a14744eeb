"""transformers' continuous batching under the settings its guide offers, side by side.

    python benchmarks/peer_settings.py [--device cuda] [--model minivllm/configs/qwen3-0.6b.json]
                                       [--workload nano] [--requests 32] [--seconds 25]

Every "× transformers" figure rests on the peer being run the way its documentation says it runs
best. This script runs the same requests (greedy, EOS ignored, each its own length) once per
setting in SETTINGS (course/bench/peers.py's PeerSettings: attention implementation, tokens per
step, CUDA graphs), each on a fresh transformers copy of the same weights, its manager started
and warmed up on two requests before the clock starts (as an engine is built before it is
timed), each stopped after --seconds. It saves, per setting, the requests finished, useful tok/s
and the attention implementation transformers really used, to
benchmarks/results/51_peer_settings_<device>.json; PEER_SETTINGS should be the fastest that
finished everything.
"""
from __future__ import annotations

import gc
import time

import torch

from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results, useful_tokens
from minivllm.course.bench.peers import (PEER_SETTINGS, PeerSettings, PeerUnavailable, continuous_batching,
                                         continuous_batching_unavailable, generate_on, to_transformers)
from minivllm.course.bench.workloads import WORKLOADS, make_workload
from minivllm.machine import environment, synchronize

SETTINGS = {
    "the benchmarks' (PEER_SETTINGS)": PEER_SETTINGS,
    "transformers' defaults (batch tokens too)": PeerSettings(max_batch_tokens=None),
    "paged|eager attention": PeerSettings(attn_implementation="paged|eager"),
    "no CUDA graphs": PeerSettings(use_cuda_graph=False),
}


def main() -> int:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--workload", default=None, choices=list(WORKLOADS), help="default: nano on a GPU, tiny on a CPU")
    parser.add_argument("--requests", type=int, default=None, help="default: 32 on a GPU, 2 on a CPU")
    parser.add_argument("--seconds", type=float, default=25.0, help="the most each setting may take")
    args = parser.parse_args()
    if reason := continuous_batching_unavailable():
        console.print(f"[yellow]nothing to measure:[/] {reason}")
        return 0
    if not args.seconds > 0 or (args.requests is not None and args.requests < 1):
        parser.error("--seconds and --requests must be positive")
    model = load_for_chapter(args)
    on_gpu = model.device.type == "cuda"
    work = make_workload(args.workload or ("nano" if on_gpu else "tiny"), model.config.vocab_size, seed=args.seed,
                         num_requests=args.requests or (32 if on_gpu else 2))
    console.print(f"[bold]workload[/] {work.describe()}")
    rows = []
    payload = dict(environment=environment(model), workload=work.describe(), seconds_each=args.seconds, rows=rows,
                   created=time.strftime("%Y-%m-%d %H:%M:%S"))
    for name, settings in SETTINGS.items():
        hf = to_transformers(model)
        row = dict(name=name, settings=settings.as_dict())
        try:
            with continuous_batching(hf, work.prompts, work.output_lens, settings) as manager:
                generate_on(manager, work.prompts[:2], [4, 4])  # warm-up: not timed, like the manager's start
                synchronize(model.device)
                start = time.perf_counter()
                got = generate_on(manager, work.prompts, work.output_lens, deadline=start + args.seconds)
                synchronize(model.device)
                seconds = time.perf_counter() - start
            done = [(out, n) for out, n in zip(got, work.output_lens) if out is not None]
            tokens = useful_tokens([out for out, _ in done], [n for _, n in done])
            row |= dict(seconds=seconds, requests_finished=len(done), requests=len(got), useful_tokens=tokens,
                        tokens_per_second=tokens / seconds, attn_used=hf.config._attn_implementation)
            console.print(f"{name}: {len(done)}/{len(got)} requests in {seconds:.1f} s, {tokens / seconds:,.0f} tok/s "
                          f"({row['attn_used']})")
        except (PeerUnavailable, RuntimeError, ValueError, TypeError) as error:
            row |= dict(error=f"{type(error).__name__}: {error}")
            console.print(f"{name}: [red]{row['error']}[/]")
        rows.append(row)
        save_results(f"51_peer_settings_{model.device.type}", payload, complete=False)
        del hf
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    path = save_results(f"51_peer_settings_{model.device.type}", payload, complete=True)
    console.print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
