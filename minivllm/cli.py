"""The `minivllm` command: `minivllm tour` runs the whole ladder; see `minivllm --help`."""
from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minivllm.bench.harness import add_model_arguments, dtype_argument, show_engine_log
from minivllm.bench.workloads import WORKLOADS


def _tour(args: argparse.Namespace) -> None:
    from minivllm.bench.tour import markdown_table, run_tour

    payload = run_tour(args.model, device=args.device, dtype=dtype_argument(args),
                       workload=args.workload, stages=args.stages.split(",") if args.stages else None,
                       num_requests=args.requests, seed=args.seed, check=args.check, figure=args.figure,
                       peers=not args.no_peers)
    if args.markdown:
        print(markdown_table(payload))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """`minivllm serve`'s engine settings as LLMEngine keywords. None leaves the engine's own
    choice: on a GPU, Triton attention, CUDA graphs and fused ops; prefix caching everywhere."""
    return dict(device=args.device, dtype=dtype_argument(args), block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, attention=args.attention,
                cuda_graphs=False if args.enforce_eager else None, enable_prefix_caching=args.enable_prefix_caching,
                speculative_config=args.speculative_config, disable_any_whitespace=args.disable_any_whitespace,
                tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                async_scheduling=args.async_scheduling, persistent_batch=args.persistent_batch)


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """`minivllm serve`'s server settings as build_app keywords. The API key comes from --api-key,
    else from the environment variable MINIVLLM_API_KEY (a key in a command line shows in `ps`);
    neither: the server is open."""
    from minivllm.serving.auth import API_KEY_VARIABLE

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_VARIABLE) or None
    static_batch_size = args.static_batch_size if args.scheduler == "static" else None
    return dict(max_waiting=args.max_waiting, static_batch_size=static_batch_size, max_logprobs=args.max_logprobs,
                api_key=api_key, max_request_bytes=args.max_request_bytes)


def engine_core(args: argparse.Namespace) -> str:
    """--engine-core, decided: a core process (chapter 15) unless the server needs chapter 10's
    thread (static batches; tensor parallelism, whose ranks the core would have to start)."""
    needs_thread = args.scheduler == "static" or args.tensor_parallel_size > 1
    if args.data_parallel_size > 1 and (needs_thread or args.engine_core == "thread"):
        raise SystemExit("minivllm serve: --data-parallel-size > 1 runs engine core processes (continuous batching, "
                         "one rank each): not with --scheduler static, --tensor-parallel-size > 1 or --engine-core thread")
    if args.engine_core == "process" and needs_thread:
        raise SystemExit("minivllm serve: --engine-core process serves continuous batching on one rank; "
                         "--scheduler static and --tensor-parallel-size > 1 need --engine-core thread")
    return args.engine_core or ("thread" if needs_thread else "process")


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from minivllm.engine.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.loader import load_tokenizer
    from minivllm.machine import device_name
    from minivllm.serving.app import build_app
    from minivllm.serving.async_llm import AsyncLLM
    from minivllm.serving.auth import check_api_key

    options = server_options(args)
    if options["api_key"] is not None:
        try:
            check_api_key(options["api_key"])  # before minutes of loading, not after
        except ValueError as err:
            raise SystemExit(f"minivllm serve: {err}")
    core = engine_core(args)
    name = args.served_model_name or args.model or "minivllm-default"
    died: list[bool] = []  # set when the core process dies: the server stops and exits non-zero
    server: uvicorn.Server | None = None

    def on_core_death() -> None:
        died.append(True)
        server.should_exit = True

    settings = engine_options(args)
    device, dtype = settings.pop("device"), settings.pop("dtype")
    try:
        if core == "process":
            tokenizer = load_tokenizer(args.model)
            engine = AsyncLLM(args.model, EngineConfig.from_settings(**settings), tokenizer, device, dtype,
                              threads=args.threads, max_waiting=options.pop("max_waiting"),
                              on_core_death=on_core_death)
        else:
            if args.threads is not None:
                torch.set_num_threads(args.threads)  # the CPU threads of the model's operations
            engine = LLMEngine(args.model, device, dtype, **settings)
            tokenizer = engine.tokenizer
        if args.chat_template:
            if tokenizer is None:
                raise SystemExit("--chat-template: this model has no tokenizer")
            path = Path(args.chat_template)
            tokenizer.chat_template = path.read_text() if path.is_file() else args.chat_template
        app = build_app(engine, name, **options)
    except ValueError as err:
        raise SystemExit(f"minivllm serve: {err}")
    static = options["static_batch_size"]
    if core == "thread":
        cfg, model = engine.model.config, engine.model
        ranks = f" x {args.tensor_parallel_size} processes" if args.tensor_parallel_size > 1 else ""
        where = (f"{cfg.model_type}, {cfg.num_parameters() / 1e6:.1f}M parameters, on {device_name(model.device)}"
                 f"{ranks}, {str(model.dtype).removeprefix('torch.')}; the engine in a thread of this process")
    else:
        where = "the engine core in a process of its own (GET /server_info once it is up)"
    print(f"serving {name!r}: {where}; {args.scheduler} scheduler" + (f" (batches of {static})" if static else "")
          + f"; http://{args.host}:{args.port}/v1" + ("; /v1 wants the API key" if options["api_key"] else ""))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    for stop in (signal.SIGTERM, signal.SIGINT):
        # uvicorn shuts down on these, then raises them again for the handler that was there before it:
        # this one, which lets a shutdown that went well end with exit status 0.
        signal.signal(stop, lambda *_: None)
    server.run()
    if died:
        raise SystemExit("minivllm serve: the engine core process died, so the server stopped")
    if not server.started:
        raise SystemExit("minivllm serve: the server did not start")


def _bench_serve(args: argparse.Namespace) -> None:
    from minivllm.bench.load import SLO, bench_serve

    bench_serve(args.url.split(","), concurrency=args.concurrency, rates=args.rate, workload=args.workload,
                requests=args.requests, seed=args.seed, slo=SLO(args.slo_ttft_ms / 1e3, args.slo_tokens_per_second),
                labels=args.label.split(",") if args.label else None,
                results=args.results, figure=args.figure, timeout=args.timeout, deadline=args.deadline)


def json_object(text: str) -> dict:
    """An argparse type for a JSON object on the command line (vLLM's --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _numbers(kind: type) -> Callable[[str], list]:
    """An argparse type for comma-separated numbers, e.g. 1,8,32,128."""
    def parse(text: str) -> list:
        try:
            return [kind(part) for part in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}")
    return parse


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (chapter 10)")
    add_model_arguments(serve, seed=False)
    serve.add_argument("--served-model-name", default=None, help="the name requests use (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default) serves this machine only")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--num-kv-blocks", type=int, default=None, help="default: what the memory budget holds")
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    serve.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    serve.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    serve.add_argument("--attention", default=None, choices=["torch", "triton"],
                       help="paged attention (default: triton on a GPU, torch on a CPU)")
    serve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (as vLLM's flag)")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="share the KV blocks of common prefixes (default: on, as in vLLM)")
    serve.add_argument("--speculative-config", type=json_object, default=None,
                       help='speculative decoding (chapter 12), as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    serve.add_argument("--disable-any-whitespace", action=argparse.BooleanOptionalAction, default=None,
                       help="JSON constraints (response_format, structured_outputs) without free whitespace, unless "
                            "a request says otherwise (default: on; vLLM's default is off)")
    serve.add_argument("--persistent-batch", action=argparse.BooleanOptionalAction, default=None,
                       help="keep block tables in rows across steps (chapter 16; default: on)")
    serve.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="plan step N+1 while step N runs (chapter 16; default: on on a GPU, off on a CPU)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="processes to split the model across (chapter 14); under torchrun, its world size")
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine cores, each a whole copy of the model with its own KV cache, behind this one "
                            "server (chapter 14; core processes)")
    serve.add_argument("--max-waiting", type=int, default=512, help="queued requests beyond which new ones get 503")
    serve.add_argument("--scheduler", default="continuous", choices=["continuous", "static"],
                       help="static: batches of --static-batch-size that run until their longest request is done")
    serve.add_argument("--static-batch-size", type=int, default=16)
    serve.add_argument("--max-logprobs", type=int, default=20,
                       help="the most logprobs alternatives a request may ask for (more: 400), as vLLM's")
    serve.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                       help="larger request bodies are refused (413) before they are read (default 4 MiB)")
    serve.add_argument("--api-key", default=None,
                       help="every /v1 route wants `Authorization: Bearer KEY` (default: $MINIVLLM_API_KEY, else open)")
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template (file or text) for models without one")
    serve.add_argument("--threads", type=int, default=None,
                       help="CPU threads for the model (default: torch's); leave a core to the event loop and clients")
    serve.add_argument("--engine-core", default=None, choices=["process", "thread"],
                       help="process: the engine core in a process of its own, HTTP and text in this one (chapter "
                            "15, the default); thread: chapter 10's one-process server (the default for --scheduler "
                            "static and --tensor-parallel-size > 1)")
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(run=_serve)

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A vLLM-style inference engine, one idea per chapter.")
    commands = parser.add_subparsers(dest="command", required=True)

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

    add_serve_parser(commands)  # `minivllm serve`, `minivllm bench-serve`

    from minivllm.exercises import add_subparser as add_exercises

    add_exercises(commands)  # `minivllm exercises list | make DIR`
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    show_engine_log()
    args.run(args)


if __name__ == "__main__":
    main()
