"""Chapter 10 — serving: the engine behind an OpenAI-compatible HTTP server, under load.

    python chapters/10_serving.py [--model SRC] [--device cpu|cuda] [--concurrency 1,8,32]
                                  [--requests-per-level 32] [--static-batch-size 16] [--workload classroom]

On a GPU (the Qwen3-0.6B shape, random weights, bf16, prompts as token ids; the GPU machine needs
fastapi, uvicorn, httpx and openai installed as wheels). Not run yet: its numbers are owed.
    python chapters/10_serving.py --device cuda --model minivllm/configs/qwen3-0.6b.json \\
        --workload nano --concurrency 1,8,32,128 --num-kv-blocks 16384

Two servers run inside this process, each one uvicorn in a thread on 127.0.0.1, on a port the OS
picks, over the same weights: continuous batching, and static batches of --static-batch-size
that run until their longest request is done (`minivllm serve --scheduler static`).
- the official openai client streams a completion, then a chat. The embedded model's tokenizer
  has no chat template, so the continuous server gets a plain one; the static server, started
  without one (as `minivllm serve` starts without --chat-template), answers 400;
- the server-sent events a raw HTTP stream carries, and what GET /metrics reports;
- the load test: `bench_serve` on both servers, one level after the other, both servers at each
  level: TTFT, TPOT, ITL and E2E at p50/p90/p99, throughput, goodput, and whether the SLO held
  (p99 TTFT < 500 ms and >= 50 tok/s per user). Writes
  benchmarks/results/10_serving_chapter_<device>.json and figures/10_chapter_latency_vs_concurrency[_gpu].png.
On a CPU the default load test is small (about a minute), and its client shares this process
(and Python's lock) with both servers. The chapter's full measurement runs every server in its
own process: `minivllm bench-serve` (commands in minivllm/course/bench/load.py;
benchmarks/results/10_serving_cpu.json, figures/10_latency_vs_concurrency.png).
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table
from rich.text import Text

from minivllm import LLMEngine, load_tokenizer
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.course.bench.latency import PERCENTILES
from minivllm.course.bench.load import SLO, bench_serve
from minivllm.course.bench.workloads import WORKLOADS
from minivllm.config.engine import kv_blocks_for_memory
from minivllm.machine import environment
from minivllm.entrypoints.openai.threaded import running_server
from minivllm.course.text import DEMO_PROMPT, encode_or_random

MODEL_NAME = "minivllm-chapter10"  # what requests name in "model"
ENGINE = dict(block_size=16, max_num_batched_tokens=2048, max_num_seqs=256)  # `minivllm serve`'s defaults
# A plain-text chat template (the one tests/test_ch10_serving.py uses): the embedded model was
# trained on Python files, not chats, so its tokenizer has none of its own.
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "Return the sum of a list of numbers."}]
TIMEOUT = 120.0  # seconds any one request may take


def openai_client(url: str):
    """The official client, pointed at our server (no key is checked; no retries, so that an
    error shows as it is)."""
    try:
        import openai
    except ImportError:
        raise SystemExit("this chapter streams with the official client: pip install openai") from None
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def stream_completion(url: str, prompt: str | list[int], max_tokens: int, tokenizer) -> dict[str, Any]:
    """A greedy completion streamed with the openai client, each chunk timed as it arrives."""
    start, times, pieces, finish, usage = time.perf_counter(), [], [], None, None
    stream = openai_client(url).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                                   temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter() - start)
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.model_dump()
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    pace = f", then one every {gaps[len(gaps) // 2] * 1e3:.1f} ms (median)" if gaps else ""
    shown = Text(prompt if isinstance(prompt, str) else f"{len(prompt)} prompt tokens ", style="dim")
    shown.append("".join(pieces) if tokenizer is not None else "(no tokenizer: the chunks carry no text)",
                 style="bold green")
    console.print(shown)
    console.print(f"[bold]openai client, stream=True[/]: {usage['completion_tokens']} tokens in {len(pieces)} chunks, "
                  f"finish_reason {finish!r}; the first after {times[0] * 1e3:.0f} ms{pace}")
    return dict(prompt=prompt, text="".join(pieces), chunks=len(pieces), chunk_texts=pieces, finish_reason=finish,
                usage=usage, ttft_ms=times[0] * 1e3)


def stream_chat(url: str, tokenizer) -> dict[str, Any]:
    """A chat streamed with the openai client, through the server's chat template."""
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    console.print(Text("the chat template renders the messages as:\n", style="bold") + Text(rendered, style="dim"))
    stream = openai_client(url).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=24,
                                                        temperature=0, stream=True)
    chunks = list(stream)
    role = chunks[0].choices[0].delta.role
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    console.print(Text(f"{role}: ", style="bold") + Text(text, style="bold green"))
    console.print("(a model of Python files is no chat model: what this shows is the path, messages -> template -> "
                  "tokens -> a streamed completion)")
    return dict(rendered=rendered, role=role, text=text, chunks=len(chunks))


def chat_without_template(url: str) -> dict[str, Any]:
    """A chat to a server whose tokenizer has no chat template: a clear 400, not a guess."""
    import openai

    try:
        openai_client(url).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8)
    except openai.BadRequestError as err:
        message = err.response.json()["error"]["message"]
        console.print(f"[bold]a chat to the server without a template[/]: HTTP {err.status_code}: {message}")
        return dict(status=err.status_code, message=message)
    raise RuntimeError("a chat without a chat template was answered")


def raw_events(url: str, prompt: str | list[int], max_tokens: int = 6) -> list[str]:
    """What a streamed answer is on the wire: one `data: {json}` line per chunk, a blank line
    after each, `data: [DONE]` at the end."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            lines = [line for _, line in zip(range(8 * max_tokens + 16), response.iter_lines())]
    events = [line for line in lines if line]
    console.print(f"[bold]the raw HTTP stream[/] (POST /v1/completions, stream=true, {max_tokens} tokens): "
                  f"{len(events)} events, each followed by a blank line; the first two and the last two:")
    for line in events[:2] + ["..."] + events[-2:]:
        print("   ", line)
    return lines


def read_metrics(url: str) -> dict[str, float]:
    """GET /metrics: Prometheus text. Prints the totals (not the histograms' buckets)."""
    with httpx.Client(base_url=url, timeout=TIMEOUT, trust_env=False) as http:
        body = http.get("/metrics").text
    values = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    console.print(f"[bold]GET /metrics[/] ({len(body.splitlines())} lines of Prometheus text; without the histogram "
                  f"buckets):")
    for name, value in values.items():
        print(f"    {name} {value:g}")
    return values


def full_table(payload: dict[str, Any], labels: list[str], workload: str, requests: int | list[int] | None) -> Table:
    """Every percentile of every level, one column per level and policy, side by side."""
    runs = payload["runs"]["concurrency"]
    env, levels = runs[labels[0]]["server"]["environment"], {label: runs[label]["levels"] for label in labels}
    shape = env["model"]
    per_level = (f"{requests} requests" if isinstance(requests, int) else
                 f"{', '.join(map(str, requests))} requests (by level)" if requests else "max(32, 4 × users) requests")
    table = Table(title=f"{env['device']}, {env['dtype']}, {shape['model_type']} {shape['parameters'] / 1e6:.1f}M "
                        f"({shape['num_layers']} layers, hidden {shape['hidden_size']})\nworkload {workload} "
                        f"(EOS ignored), {per_level} per level")
    columns = [(i, label) for i in range(len(levels[labels[0]])) for label in labels]
    table.add_column("")
    for i, label in columns:
        table.add_column(f"{users(levels[label][i]['concurrency'])}\n{label}", justify="right")
    for metric, unit, scale, fmt in (("ttft", "ms", 1e3, "{:,.0f}"), ("tpot", "ms", 1e3, "{:.1f}"),
                                     ("itl", "ms", 1e3, "{:.1f}"), ("e2e", "s", 1, "{:.2f}")):
        for p in PERCENTILES:
            table.add_row(f"{metric.upper()} p{p} {unit}",
                          *[fmt.format(levels[label][i][metric][f"p{p}"] * scale) if metric in levels[label][i]
                            else "—" for i, label in columns], end_section=p == PERCENTILES[-1])
    rows = (("requests done", lambda lv: f"{lv['completed']}/{lv['requests']}"),
            ("output tok/s", lambda lv: f"{lv['output_throughput']:,.0f}"),
            ("goodput req/s", lambda lv: f"{lv['goodput']:.2f}"),
            ("within the SLO", lambda lv: f"{lv['slo_fraction']:.0%}"),
            ("SLO held at p99", lambda lv: "[green]yes[/]" if lv["slo_met"] else "[red]no[/]"))
    for name, cell in rows:
        table.add_row(name, *[cell(levels[label][i]) for i, label in columns])
    return table


def users(n: float) -> str:
    return f"{n:g} user" + ("" if n == 1 else "s")


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1 (users per level, requests per level)."""
    try:
        numbers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return numbers


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=positive_ints, default=None,
                        help="simulated users per level (default: 1,8,32 on a CPU, 1,8,32,128 on a GPU)")
    parser.add_argument("--requests-per-level", type=positive_ints, default=None,
                        help="requests per level, one number for all or one per level, e.g. 8,16,64,128 "
                             "(default: 32 on a CPU; bench-serve's max(32, 4 × users) on a GPU)")
    parser.add_argument("--static-batch-size", type=int, default=16, help="the static server's batch size")
    parser.add_argument("--workload", default="classroom", choices=list(WORKLOADS), help="prompt and output lengths")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks of each server (default: 256 MiB each on a CPU, half the GPU's budget each)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    for name in ("num_kv_blocks", "threads", "static_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_for_chapter(args)
    on_gpu = model.device.type == "cuda"
    concurrency = args.concurrency or ([1, 8, 32, 128] if on_gpu else [1, 8, 32])
    requests = args.requests_per_level or (None if on_gpu else [32])
    if len(requests or []) not in (0, 1, len(concurrency)):
        parser.error(f"--requests-per-level: one number, or one per level ({len(concurrency)}), got {requests}")
    requests = requests if requests is None or len(requests) > 1 else requests[0]
    blocks = args.num_kv_blocks
    if blocks is None and on_gpu:  # two servers share the GPU: each gets half of what one would take
        blocks = kv_blocks_for_memory(model, ENGINE["block_size"], ENGINE["max_num_seqs"],
                                      model.config.max_position_embeddings) // 2
    # Prefix caching (chapter 11) stays off: every level sends the same seeded prompts, and a
    # cache would let each level find the last one's blocks.
    engine = dict(ENGINE, num_kv_blocks=blocks, enable_prefix_caching=False)
    chatty, plain = load_tokenizer(args.model), load_tokenizer(args.model)  # one gets a template, one does not
    if chatty is not None:
        chatty.chat_template = CHAT_TEMPLATE
    # Text when there is a tokenizer; random token ids when there is none (a config-only shape).
    prompt = DEMO_PROMPT if chatty is not None else encode_or_random(None, DEMO_PROMPT, model.config.vocab_size)
    facts: dict[str, Any] = {}
    start = time.perf_counter()

    with ExitStack() as servers:
        continuous_url, _ = servers.enter_context(running_server(LLMEngine(model, tokenizer=chatty, **engine),
                                                                 MODEL_NAME))
        static_url, _ = servers.enter_context(running_server(LLMEngine(model, tokenizer=plain, **engine), MODEL_NAME,
                                                             static_batch_size=args.static_batch_size))
        facts["urls"] = dict(continuous=continuous_url, static=static_url)
        console.print(f"[bold]servers[/] continuous at {continuous_url}/v1, static (batches of "
                      f"{args.static_batch_size}) at {static_url}/v1, in this process")
        for url in (continuous_url, static_url):  # the first request pays for first-call costs: not this one
            openai_client(url).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
        facts["completion"] = stream_completion(continuous_url, prompt, 32, chatty)
        if chatty is not None:
            facts["chat"] = stream_chat(continuous_url, chatty)
        facts["chat_without_template"] = chat_without_template(static_url)
        facts["raw_events"] = raw_events(continuous_url, prompt)
        facts["metrics"] = read_metrics(continuous_url)

        console.print(f"\n[bold]load test[/]: both servers at {len(concurrency)} levels; on each level the "
                      f"continuous server runs, then the static one")
        slo = SLO()
        suffix = "_gpu" if on_gpu else ""
        payload = bench_serve([continuous_url, static_url], concurrency=concurrency, workload=args.workload,
                              requests=requests, seed=args.seed, slo=slo, labels=["continuous", "static"],
                              results=f"10_serving_chapter_{model.device.type}",
                              figure=f"10_chapter_latency_vs_concurrency{suffix}", timeout=TIMEOUT,
                              deadline=max(600.0, 10 * TIMEOUT))
    console.print("servers stopped: "
                  + ("none left running" if not any(t.name in ("uvicorn", "minivllm-engine") and t.is_alive()
                                                    for t in threading.enumerate()) else "[red]some still run[/]"))

    console.print(full_table(payload, ["continuous", "static"], args.workload, requests))
    best = {label: payload["runs"]["concurrency"][label]["highest_level_meeting_slo"] for label in ("continuous", "static")}
    console.print(f"The usual claim: continuous batching serves 100+ concurrent users with p99 TTFT under "
                  f"{slo.ttft * 1e3:g} ms and {slo.tokens_per_second:g}+ tok/s each. Here the SLO held up to "
                  + ", ".join(f"{users(b) if b is not None else 'no level'} ({label})" for label, b in best.items())
                  + f" of the levels {', '.join(map(str, concurrency))}."
                  + ("" if on_gpu else " On this CPU the client and both servers share one Python process; "
                     "`minivllm bench-serve` measures each server in its own."))
    payload |= dict(chapter=dict(environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"),
                                 engine=engine, static_batch_size=args.static_batch_size,
                                 load_average=list(os.getloadavg()), seconds=time.perf_counter() - start,
                                 highest_level_meeting_slo=best, **facts))
    path = save_results(f"10_serving_chapter_{model.device.type}", payload)
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
