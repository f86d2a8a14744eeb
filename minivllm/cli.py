"""The `minivllm` command: `minivllm tour` runs the whole ladder; see `minivllm --help`."""
from __future__ import annotations

import argparse

import torch

from minivllm.bench import WORKLOADS, add_model_arguments, dtype_argument


def _tour(args: argparse.Namespace) -> None:
    from minivllm.tour import markdown_table, run_tour

    payload = run_tour(args.model, device=args.device, dtype=dtype_argument(args),
                       workload=args.workload, stages=args.stages.split(",") if args.stages else None,
                       num_requests=args.requests, seed=args.seed, check=args.check, figure=args.figure,
                       peers=not args.no_peers)
    if args.markdown:
        print(markdown_table(payload))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A vLLM-style inference engine, one idea per chapter.")
    commands = parser.add_subparsers(dest="command", required=True)

    tour = commands.add_parser("tour", help="every stage on one workload: table, JSON and figures/ladder.png")
    add_model_arguments(tour)
    tour.add_argument("--workload", default="classroom", choices=list(WORKLOADS))
    tour.add_argument("--stages", default=None, help="comma-separated subset of the stages (default: all)")
    tour.add_argument("--requests", type=int, default=None, help="override the workload's number of requests")
    tour.add_argument("--check", type=int, default=4, help="requests compared with transformers' greedy tokens")
    tour.add_argument("--no-peers", action="store_true", help="skip transformers' generate and generate_batch")
    tour.add_argument("--markdown", action="store_true", help="also print the table as Markdown (for the README)")
    tour.add_argument("--figure", default=None, help="figure name under figures/ (default: ladder or ladder_cuda)")
    tour.set_defaults(run=_tour)

    from minivllm.exercises import add_subparser as add_exercises

    add_exercises(commands)  # `minivllm exercises list | make DIR`
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    args.run(args)


if __name__ == "__main__":
    main()
