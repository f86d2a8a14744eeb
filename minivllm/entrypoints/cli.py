"""The `minivllm` command: `minivllm serve` runs the OpenAI-compatible server; the course adds its
commands (`tour`, `bench-serve`, `exercises`) through an entry point; see `minivllm --help`."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.logging import RichHandler

console = Console()  # where the engine's log is shown


def add_model_arguments(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """--model, --device, --dtype and (with `seed`) --seed: what every script, `minivllm tour`
    and `minivllm serve` run on."""
    parser.add_argument("--model", default=None, help="checkpoint folder, hub id or config.json (default: the embedded model)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if available")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="default: fp32 on CPU, bf16 on CUDA")
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic workload")


def dtype_argument(args: argparse.Namespace) -> torch.dtype | None:
    """--dtype as a torch dtype (None: the device's default)."""
    return getattr(torch, args.dtype) if args.dtype else None


def show_engine_log() -> None:
    """Print what the engine logs (logger "minivllm": the KV cache it sized for itself, a server's
    warnings) on this console. The library only logs; scripts and the CLI decide to show it."""
    logger = logging.getLogger("minivllm")
    if not any(isinstance(h, RichHandler) for h in logger.handlers):
        logger.addHandler(RichHandler(console=console, show_time=False, show_path=False, markup=False))
        logger.setLevel(logging.INFO)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """`minivllm serve`'s engine settings as LLMEngine keywords. None leaves the engine's own
    choice: on a GPU, Triton attention, CUDA graphs and fused ops; prefix caching everywhere."""
    return dict(device=args.device, dtype=dtype_argument(args), block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, attention=args.attention,
                cuda_graphs=False if args.enforce_eager else None, enable_prefix_caching=args.enable_prefix_caching,
                speculative_config=args.speculative_config, disable_any_whitespace=args.disable_any_whitespace,
                tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
                async_scheduling=args.async_scheduling, persistent_batch=args.persistent_batch,
                kv_transfer_config=args.kv_transfer_config,
                long_prefill_token_threshold=args.long_prefill_token_threshold)


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """`minivllm serve`'s server settings as build_app keywords. The API key comes from --api-key,
    else from the environment variable MINIVLLM_API_KEY (a key in a command line shows in `ps`),
    else from vLLM's VLLM_API_KEY; none (or MINIVLLM_API_KEY empty): the server is open."""
    from minivllm.entrypoints.openai.auth import API_KEY_VARIABLE, VLLM_API_KEY_VARIABLE

    api_key = args.api_key if args.api_key is not None else \
        os.environ.get(API_KEY_VARIABLE, os.environ.get(VLLM_API_KEY_VARIABLE)) or None
    static_batch_size = args.static_batch_size if args.scheduler == "static" else None
    return dict(max_waiting=args.max_waiting, static_batch_size=static_batch_size, max_logprobs=args.max_logprobs,
                api_key=api_key, max_request_bytes=args.max_request_bytes, root_path=args.root_path,
                return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                enable_force_include_usage=args.enable_force_include_usage,
                enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                enable_per_request_metrics=args.enable_per_request_metrics,
                trust_request_chat_template=args.trust_request_chat_template)


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

    from minivllm.config.engine import EngineConfig
    from minivllm.engine.async_llm import AsyncLLM
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.openai.app import build_app
    from minivllm.entrypoints.openai.auth import check_api_key
    from minivllm.loader import load_tokenizer
    from minivllm.machine import device_name

    options = server_options(args)
    if options["api_key"] is not None:
        try:
            check_api_key(options["api_key"])  # before minutes of loading, not after
        except ValueError as err:
            raise SystemExit(f"minivllm serve: {err}")
    core = engine_core(args)
    name = args.served_model_name or args.model or "minivllm-default"
    if args.api_server_count > 1:
        return _serve_api_servers(args, core, name, options)
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
    address = f"the Unix socket {args.uds}" if args.uds else f"http://{args.host}:{args.port}{args.root_path}/v1"
    print(f"serving {name!r}: {where}; {args.scheduler} scheduler" + (f" (batches of {static})" if static else "")
          + f"; {address}" + ("; /v1 wants the API key" if options["api_key"] else ""))
    # --uds: uvicorn listens on the socket file instead of host:port (a proxy on the same machine
    # connects to it; nothing on the network can)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, uds=args.uds, log_level=args.log_level,
                                           timeout_graceful_shutdown=5))
    for stop in (signal.SIGTERM, signal.SIGINT):
        # uvicorn shuts down on these, then raises them again for the handler that was there before it:
        # this one, which lets a shutdown that went well end with exit status 0.
        signal.signal(stop, lambda *_: None)
    try:
        server.run()
    finally:
        if args.uds:  # uvicorn leaves the socket file, and a file left there stops the next start
            Path(args.uds).unlink(missing_ok=True)
    if died:
        raise SystemExit("minivllm serve: the engine core process died, so the server stopped")
    if not server.started:
        raise SystemExit("minivllm serve: the server did not start")


def _serve_api_servers(args: argparse.Namespace, core: str, name: str, options: dict[str, Any]) -> None:
    """--api-server-count N > 1 (issue 48): N API server processes on one port in front of the
    engine core process(es); entrypoints/openai/api_servers.py says who starts and binds what."""
    from minivllm.config.engine import EngineConfig
    from minivllm.entrypoints.openai.api_servers import (
        APIServerSettings,
        serve_api_servers,
    )

    if core != "process":
        raise SystemExit("minivllm serve: --api-server-count > 1 needs the engine core in processes of its own "
                         "(continuous batching, --tensor-parallel-size 1, not --engine-core thread)")
    settings = engine_options(args)
    device, dtype = settings.pop("device"), settings.pop("dtype")
    try:
        config = EngineConfig.from_settings(**settings)
    except ValueError as err:
        raise SystemExit(f"minivllm serve: {err}")
    max_waiting = options.pop("max_waiting")
    server = APIServerSettings(args.model, config, name, options, max_waiting, args.chat_template, args.log_level)
    print(f"serving {name!r}: {args.api_server_count} API server processes in front of "
          f"{args.data_parallel_size} engine core process(es); "
          + (f"the Unix socket {args.uds}" if args.uds else f"http://{args.host}:{args.port}{args.root_path}/v1")
          + ("; /v1 wants the API key" if options["api_key"] else ""))
    try:
        failure = serve_api_servers(server, args.api_server_count, args.host, args.port, device, dtype, args.threads,
                                    args.uds)
    except OSError as err:  # the port is taken, say
        raise SystemExit(f"minivllm serve: {err}")
    if failure is not None:
        raise SystemExit(f"minivllm serve: {failure}")


def api_server_count(text: str) -> int:
    """An argparse type for --api-server-count: a whole number of processes, at least 1."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of processes, at least 1; got {text!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"at least 1 API server process; got {count}")
    return count


def json_object(text: str) -> dict:
    """An argparse type for a JSON object on the command line (vLLM's --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (chapter 10)")
    add_model_arguments(serve, seed=False)
    serve.add_argument("--served-model-name", default=None, help="the name requests use (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default) serves this machine only")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--uds", default=None, help="serve on this Unix socket file instead of --host and --port")
    serve.add_argument("--root-path", default="",
                       help="the path prefix a proxy in front adds (e.g. /api): routes answer with and without it")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--num-kv-blocks", type=int, default=None, help="default: what the memory budget holds")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step (default: by the device, 2,048 on a CPU, 8,192 on an H100/H200)")
    serve.add_argument("--max-num-seqs", type=int, default=None,
                       help="most requests running at once (default: by the device, 256 on a CPU, 1,024 on an H100/H200)")
    serve.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="most prompt tokens one request gets per step, so a burst of users starts together (0: no cap)")
    serve.add_argument("--max-model-len", type=int, default=None, help="default: the model's context")
    serve.add_argument("--attention", default=None, choices=["torch", "triton"],
                       help="paged attention (default: triton on a GPU, torch on a CPU)")
    serve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (as vLLM's flag)")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="share the KV blocks of common prefixes (default: on, as in vLLM)")
    serve.add_argument("--speculative-config", type=json_object, default=None,
                       help='speculative decoding (chapter 12), as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'')
    serve.add_argument("--kv-transfer-config", type=json_object, default=None,
                       help='disaggregated prefill (chapter 17), as JSON, e.g. \'{"kv_connector": "SharedStorageConnector", '
                            '"kv_role": "kv_consumer", "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}\'')
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
                       help="the most logprobs alternatives a request may ask for (more: 400; -1: no cap), as vLLM's")
    serve.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                       help="larger request bodies are refused (413) before they are read (default 4 MiB)")
    serve.add_argument("--api-key", default=None,
                       help="every /v1 route wants `Authorization: Bearer KEY` (default: $MINIVLLM_API_KEY, else $VLLM_API_KEY, "
                            "else open)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help='logprobs name tokens "token_id:<id>" unless a request says otherwise (vLLM\'s flag)')
    serve.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream carries usage, asked for or not: in every chunk and at the end (vLLM's flag)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache held (vLLM's flag)")
    serve.add_argument("--enable-per-request-metrics", action="store_true",
                       help='a "metrics" field with each answer\'s timings (a stream: on its usage chunk; vLLM\'s flag)')
    serve.add_argument("--chat-template", default=None, help="a Jinja chat template (file or text) for models without one")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request bring its own chat_template (Jinja the server runs; vLLM's flag)")
    serve.add_argument("--threads", type=int, default=None,
                       help="CPU threads for the model (default: torch's); leave a core to the event loop and clients")
    serve.add_argument("--engine-core", default=None, choices=["process", "thread"],
                       help="process: the engine core in a process of its own, HTTP and text in this one (chapter "
                            "15, the default); thread: chapter 10's one-process server (the default for --scheduler "
                            "static and --tensor-parallel-size > 1)")
    serve.add_argument("--api-server-count", type=api_server_count, default=1,
                       help="API server processes (HTTP, tokenizing, detokenizing, SSE) on this one port in front "
                            "of the engine core process(es) (issue 48; default 1; on a GPU host see the README)")
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(run=_serve)


def add_disagg_proxy_parser(commands: argparse._SubParsersAction) -> None:
    proxy = commands.add_parser("disagg-proxy", help="one address in front of a prefill and a decode instance (chapter 17)")
    proxy.add_argument("--prefill", required=True, help="the prefill instance's base url, e.g. http://127.0.0.1:8100")
    proxy.add_argument("--decode", required=True, help="the decode instance's base url, e.g. http://127.0.0.1:8200")
    proxy.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default) serves this machine only")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.set_defaults(run=_disagg_proxy)


def _disagg_proxy(args: argparse.Namespace) -> None:
    import uvicorn

    from minivllm.entrypoints.disagg_proxy import build_proxy

    uvicorn.run(build_proxy(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minivllm", description="A vLLM-style inference engine, one idea per chapter.")
    commands = parser.add_subparsers(dest="command", required=True)

    add_serve_parser(commands)  # `minivllm serve`
    add_disagg_proxy_parser(commands)  # `minivllm disagg-proxy` (chapter 17)
    # Other packages add commands through the entry-point group "minivllm.commands" (pyproject.toml):
    # the course registers `tour`, `bench-serve` and `exercises` there, so this module never imports it.
    for entry_point in importlib.metadata.entry_points(group="minivllm.commands"):
        entry_point.load()(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    show_engine_log()
    args.run(args)


if __name__ == "__main__":
    main()
