"""The course's `minivllm` subcommands, registered through the entry-point group "minivllm.commands"
(pyproject.toml), so that the product CLI (entrypoints/cli.py) never imports the course:

    minivllm tour          every stage on one workload: table, JSON and figures/ladder.png
    minivllm bench-serve   load-test a running server: TTFT, TPOT, ITL, goodput
    minivllm exercises     the classroom's exercises: list them, make a student copy
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

from minivllm.course.bench.workloads import WORKLOADS
from minivllm.entrypoints.cli import add_model_arguments, dtype_argument


def _tour(args: argparse.Namespace) -> None:
    from minivllm.course.bench.tour import markdown_table, run_tour

    payload = run_tour(args.model, device=args.device, dtype=dtype_argument(args),
                       workload=args.workload, stages=args.stages.split(",") if args.stages else None,
                       num_requests=args.requests, seed=args.seed, check=args.check, figure=args.figure,
                       peers=not args.no_peers)
    if args.markdown:
        print(markdown_table(payload))


def _bench_serve(args: argparse.Namespace) -> None:
    from minivllm.course.bench.load import SLO, bench_serve

    bench_serve(args.url.split(","), concurrency=args.concurrency, rates=args.rate, workload=args.workload,
                requests=args.requests, seed=args.seed, slo=SLO(args.slo_ttft_ms / 1e3, args.slo_tokens_per_second),
                labels=args.label.split(",") if args.label else None,
                results=args.results, figure=args.figure, timeout=args.timeout, deadline=args.deadline)


def _numbers(kind: type) -> Callable[[str], list]:
    """An argparse type for comma-separated numbers, e.g. 1,8,32,128."""
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}")
    return parse


def register(commands: argparse._SubParsersAction) -> None:
    """Add the course's subcommands to the `minivllm` parser."""
    tour = commands.add_parser("tour", help="every stage on one workload: table, JSON and figures/ladder.png")
    add_model_arguments(tour)
    tour.add_argument("--workload", default=None, choices=list(WORKLOADS),
                      help="default: classroom on a CPU, ladder_gpu on a GPU (with the Qwen3-0.6B shape)")
    tour.add_argument("--stages", default=None, help="comma-separated subset of the stages (default: all)")
    tour.add_argument("--requests", type=int, default=None, help="override the workload's number of requests")
    tour.add_argument("--check", type=int, default=4, help="requests compared with transformers' greedy tokens")
    tour.add_argument("--no-peers", action="store_true", help="skip transformers' generate and generate_batch")
    tour.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for the README)")
    tour.add_argument("--figure", default=None, help="figure name under figures/ (default: ladder or ladder_cuda)")
    tour.set_defaults(run=_tour)

    bench = commands.add_parser("bench-serve", help="load-test a running server: TTFT, TPOT, ITL, goodput")
    bench.add_argument("--url", default="http://127.0.0.1:8000",
                       help="a server, or several separated by commas: each level then runs on each in turn")
    levels = bench.add_mutually_exclusive_group(required=True)
    levels.add_argument("--concurrency", type=_numbers(int), help="users in a closed loop, e.g. 1,8,32,128")
    levels.add_argument("--rate", type=_numbers(float), help="Poisson request rates (requests/s), e.g. 1,4,16")
    bench.add_argument("--workload", default="classroom", choices=list(WORKLOADS))
    bench.add_argument("--requests", type=int, default=None,
                       help="requests per level (default: max(32, 4 x concurrency) or max(32, 16 x rate))")
    bench.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")
    bench.add_argument("--slo-ttft-ms", type=float, default=500.0)
    bench.add_argument("--slo-tokens-per-second", type=float, default=50.0, help="per user")
    bench.add_argument("--label", default=None,
                       help="each server's name in the results, comma-separated (default: its scheduler)")
    bench.add_argument("--results", default=None, help="benchmarks/results/NAME.json (default: 10_serving_cpu or _gpu)")
    bench.add_argument("--figure", default=None, help="figures/NAME.png (default: 10_latency_vs_concurrency or _rate)")
    bench.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    bench.add_argument("--deadline", type=float, default=900.0, help="seconds one level may take")
    bench.set_defaults(run=_bench_serve)



    from minivllm.course.exercises import add_subparser as add_exercises

    add_exercises(commands)  # `minivllm exercises list | make DIR`
