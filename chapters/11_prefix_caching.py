"""Chapter 11 — prefix caching: requests that begin with the same tokens share their KV blocks.

    python chapters/11_prefix_caching.py [--model SRC] [--device cpu|cuda] [--requests 32] [--prefix 200]
                                         [--repeats 3] [--rate 8] [--threads N]

On a GPU (the Qwen3-0.6B shape, random weights, bf16; 256 requests as the "shared prefix" workload allows):
    python chapters/11_prefix_caching.py --device cuda --model minivllm/configs/qwen3-0.6b.json --requests 256

- a sample: three code prompts under one module header, the tokens each found in the cache;
- two or three requests that share a system prompt, their block tables pointing at the same
  physical blocks, with reference counts (figures/11_shared_blocks.png);
- n samples of one prompt compute it once (vLLM's `n`);
- the benchmark: a 200-token system prompt shared by every request (50-90 % of each prompt),
  caching on vs off side by side in one run, repeats interleaved: time to first token (all
  requests at once, and Poisson arrivals), useful throughput, prompt tokens computed, peak KV;
- the same against the shared share of a fixed-length prompt, 0 to 90 % (figures/11_shared_prefix.png);
- a multi-turn chat, each turn's prompt the last one plus its answer plus a new message
  (figures/11_multi_turn.png).
JSON: benchmarks/results/11_prefix_caching_<device>.json. Every engine here is fresh (nothing
cached before the run) and sized so that no request is preempted: the counts of work are then
exact, and the same on every machine.
"""
from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import statistics
import time

import numpy as np
import torch
from rich.table import Table

from minivllm import LLM, LLMEngine, SamplingParams, load_tokenizer
from minivllm.course import plots
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.course.bench.online import latency_summary, serve_continuous
from minivllm.course.bench.workloads import Workload, make_multi_turn_workload, make_shared_prefix_workload
from minivllm.core.trace import Trace
from minivllm.machine import device_name, environment, synchronize
from minivllm.course.plots.prefix import plot_multi_turn, plot_prefix_sweep, plot_shared_blocks
from minivllm.course.text import DEMO_PROMPTS, random_prompts, show_sample

ENGINE = dict(block_size=16, max_num_batched_tokens=2048, max_num_seqs=256)
SETTINGS = {"caching on": True, "caching off": False}
SHARES = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9]
OUTPUT = (8, 32)  # "short" outputs of the shared-prefix workload
SWEEP_OUTPUT = (4, 16)  # shorter still in the sweep: its subject is the prompt
HEADER = ('"""Small helpers for files, paths and text.\n\nEvery function here takes str paths, never opens a file '
          'it was not\nasked to, and returns plain Python objects.\n"""\nimport os\nimport re\nimport sys\n\n\n')


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def fresh_llm(model, caching: bool, num_kv_blocks: int, tokenizer=None) -> LLM:
    """A new engine: its cache starts empty, so one run never finds another's blocks."""
    if model.device.type == "cuda":  # hand the last engine's KV pool back first (a GPU holds few)
        gc.collect()
        torch.cuda.empty_cache()
    llm = LLM(model, tokenizer=tokenizer, enable_prefix_caching=caching, num_kv_blocks=num_kv_blocks, **ENGINE)
    llm.trace = Trace()
    return llm


def pool_for(prompts: list[list[int]], output_lens: list[int]) -> int:
    """KV blocks for every request at its longest at once (no preemption, nothing evicted)."""
    size = ENGINE["block_size"]
    return sum(-(-(len(p) + n) // size) for p, n in zip(prompts, output_lens)) + 1


def work_counts(trace: Trace, steps: slice = slice(None)) -> dict:
    """What the engine computed, from its trace: independent of the machine."""
    records = trace.steps[steps]
    return dict(prompt_tokens_computed=sum(s.num_prefill_tokens for s in records),
                decode_tokens=sum(len(s.decode) for s in records),
                cached_tokens=sum(s.cached_tokens for s in records),
                peak_kv_blocks=max(s.kv_reserved_tokens for s in records) // ENGINE["block_size"],
                peak_kv_tokens_held=max(s.kv_tokens for s in records),
                steps=len(records), preemptions=sum(len(s.preempted) for s in records))


def digest(outputs: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


def run_at_once(model, work: Workload, caching: bool) -> dict:
    """Every request of `work` queued at once, then stepped to the end (LLM.generate).
    TTFT = first token - arrival, from each RequestOutput's metrics; percentiles as
    online.latency_summary takes them."""
    llm = fresh_llm(model, caching, pool_for(work.prompts, work.output_lens))
    synchronize(model.device)
    start = time.perf_counter()
    outs = llm.generate(work.prompts, [greedy(n) for n in work.output_lens], use_tqdm=False)
    synchronize(model.device)
    seconds = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tokens = [o.outputs[0].token_ids for o in outs]
    return dict(seconds=seconds, tokens_per_second=sum(map(len, tokens)) / seconds,
                ttft_p50=float(np.percentile(ttfts, 50)), ttft_p90=float(np.percentile(ttfts, 90)),
                outputs_digest=digest(tokens), **work_counts(llm.trace))


def run_arrivals(model, work: Workload, caching: bool) -> dict:
    """Requests added as they arrive (Poisson), each step's real time advancing the clock."""
    engine = LLMEngine(model, enable_prefix_caching=caching, num_kv_blocks=pool_for(work.prompts, work.output_lens),
                       **ENGINE)
    summary = latency_summary(serve_continuous(engine, work))
    return dict(ttft_p50=summary["ttft"]["p50"], ttft_p90=summary["ttft"]["p90"],
                tokens_per_second=summary["throughput"]["useful_tokens_per_second"])


def interleaved(repeats: int):
    """(repeat, setting, caching) with the order of the settings alternating between repeats,
    so that a drift in the machine's load does not always favour the same one."""
    for r in range(repeats):
        for name in (list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]):
            yield r, name, SETTINGS[name]


def speedups(off_runs: list[dict], on_runs: list[dict]) -> dict:
    """What caching buys, as the median over side-by-side pairs of runs (a busy machine's drift
    cancels in each pair): TTFT off / on (how many times sooner the first token comes) and
    throughput on / off."""
    pairs = list(zip(off_runs, on_runs))
    ratios = {k: statistics.median(off[k] / on[k] for off, on in pairs) for k in ("ttft_p50", "ttft_p90")}
    return ratios | dict(tokens_per_second=statistics.median(on["tokens_per_second"] / off["tokens_per_second"]
                                                             for off, on in pairs))


# ------------------------------------------------------------------------------------------


def sample(model, tokenizer) -> dict:
    """Three prompts under one module header: the header's full blocks are computed once."""
    if tokenizer is not None:
        prompts = [tokenizer.encode(HEADER + p) for p in DEMO_PROMPTS]
    else:  # a config-only shape: a random "header" and random questions
        header = random_prompts([48], model.config.vocab_size, seed=1)[0]
        prompts = [header + p for p in random_prompts([5, 9, 14], model.config.vocab_size, seed=2)]
    outputs = {}
    for name, caching in SETTINGS.items():
        llm = fresh_llm(model, caching, 64, tokenizer)
        outputs[name] = llm.generate(prompts, greedy(40), use_tqdm=False)
    cached = outputs["caching on"]
    show_sample(tokenizer, prompts[1], cached[1].outputs[0].token_ids, "LLM.generate, prefix caching on")
    same = [a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cached, outputs["caching off"])]
    table = Table(title=f"Three prompts under one module header ({ENGINE['block_size']}-token blocks)")
    for column in ("request", "prompt tokens", "found in the cache", "computed", "same tokens as without cache"):
        table.add_column(column, justify="right")
    for i, (out, ok) in enumerate(zip(cached, same)):
        n = len(out.prompt_token_ids)
        found = out.num_cached_tokens
        table.add_row(str(i), str(n), str(found), str(n - found), "✓" if ok else "✗")
    console.print(table)
    return dict(prompt_tokens=[len(p) for p in prompts], cached_tokens=[o.num_cached_tokens for o in cached],
                same_tokens=all(same))


def shared_blocks(model) -> tuple[dict, plots.Figure]:
    """Request 0 computes a 13-token system prompt and finishes; requests 1-3 arrive with the
    same system prompt and are caught mid-decode: their tables start with request 0's blocks."""
    block_size, vocab = 4, model.config.vocab_size
    system = random_prompts([13], vocab, seed=1)[0]
    users = random_prompts([6, 5, 9, 3], vocab, seed=2)
    engine = LLMEngine(model, block_size=block_size, num_kv_blocks=20)
    engine.add_request(prompt=system + users[0], params=greedy(4), request_id="request 0")
    while engine.has_unfinished_requests():
        engine.step()
    for i in (1, 2, 3):
        engine.add_request(prompt=system + users[i], params=greedy(6), request_id=f"request {i}")
    for _ in range(3):  # admission (with the cached prefix) and two decode steps
        engine.step()
    manager = engine.core.block_manager
    running = engine.core.scheduler.running
    tables = {s.request_id: list(s.block_table) for s in running}
    held = {s.request_id: s.num_computed_tokens for s in running}
    full = len(system) // block_size
    title = (f"A {len(system)}-token system prompt in {block_size}-token blocks: request 0 computed its {full} full "
             f"blocks and finished;\nrequests 1-3 found them in the cache and hold them together (ref 3). Its "
             f"last token shares a block with each request's own tokens,\nso each computes that block itself: only "
             f"full blocks are shared. Request 0's other full blocks stay findable until evicted.")
    fig = plot_shared_blocks(tables, held, manager.ref_counts, set(manager.block_hash), title)
    return dict(block_size=block_size, system_prompt_tokens=len(system), tables=tables,
                cached_tokens={s.request_id: s.num_cached_tokens for s in running},
                ref_counts=list(manager.ref_counts)), fig


def n_completions(model, n: int = 4, prompt_len: int = 120) -> dict:
    """vLLM's n: the n samples of one prompt are n sequences; with the cache the first computes
    the prompt and the others, admitted in the same step, reuse its full blocks."""
    prompt = random_prompts([prompt_len], model.config.vocab_size, seed=3)[0]
    params = SamplingParams(n=n, max_tokens=8, temperature=0.8, seed=0, ignore_eos=True)
    result = {}
    for name, caching in SETTINGS.items():
        llm = fresh_llm(model, caching, 4 * n * (-(-prompt_len // ENGINE["block_size"]) + 1))
        llm.generate(prompt, params, use_tqdm=False)
        first = llm.trace.steps[0]
        result[name] = dict(first_step_prefill=sorted(first.prefill.values(), reverse=True),
                            prompt_tokens_computed=sum(s.num_prefill_tokens for s in llm.trace.steps),
                            cached_tokens=llm.trace.num_cached_tokens)
    on, off = result["caching on"], result["caching off"]
    console.print(f"[bold]n = {n} samples of a {prompt_len}-token prompt[/]: prompt tokens computed per sample "
                  f"{on['first_step_prefill']} with the cache ({on['prompt_tokens_computed']} in all), "
                  f"{off['first_step_prefill']} without ({off['prompt_tokens_computed']})")
    return dict(n=n, prompt_tokens=prompt_len, **result)


def headline(model, args) -> dict:
    """The shared-prefix workload, caching on vs off, repeats interleaved."""
    suffix = (-(-args.prefix // 9), args.prefix)  # the shared part is 50-90 % of each prompt
    # One workload for both: all at once ignores the arrival times, the online runs follow them.
    work = make_shared_prefix_workload(model.config.vocab_size, args.prefix, args.requests, suffix, OUTPUT, args.seed,
                                       rate=args.rate)
    console.print(f"[bold]workload[/] {work.describe()}; all at once, and Poisson arrivals at {args.rate} req/s")
    for caching in SETTINGS.values():  # warm-up
        run_at_once(model, work.subset(min(4, len(work.prompts))), caching)
    runs: dict[str, dict[str, list[dict]]] = {name: {"at_once": [], "arrivals": []} for name in SETTINGS}
    with console.status(f"{args.repeats} interleaved repeats of caching on / off ..."):
        for _, name, caching in interleaved(args.repeats):
            runs[name]["at_once"].append(run_at_once(model, work, caching))
        for _, name, caching in interleaved(args.repeats):
            runs[name]["arrivals"].append(run_arrivals(model, work, caching))
    gains = {mode: speedups(runs["caching off"][mode], runs["caching on"][mode]) for mode in ("at_once", "arrivals")}
    counts = {name: {k: v for k, v in runs[name]["at_once"][0].items()
                     if k not in ("seconds", "tokens_per_second", "ttft_p50", "ttft_p90")} for name in SETTINGS}
    kv_bytes = model.config.kv_bytes_per_token(model.dtype) * ENGINE["block_size"]
    table = Table(title=f"{work.describe()}\n{device_name(model.device)}, {str(model.dtype).removeprefix('torch.')}; "
                        f"median of {args.repeats} interleaved repeats")
    for column in ("", "TTFT p50 / p90, all at once", "useful tok/s", f"TTFT p50 / p90, {args.rate} req/s",
                   "prompt tokens computed", "found in cache", "peak KV blocks"):
        table.add_column(column, justify="right")
    for name in SETTINGS:
        c = counts[name]
        med = {f"{m}.{k}": statistics.median(r[k] for r in runs[name][m])
               for m in ("at_once", "arrivals") for k in ("ttft_p50", "ttft_p90", "tokens_per_second")}
        table.add_row(name, f"{med['at_once.ttft_p50']:.3f} / {med['at_once.ttft_p90']:.3f} s",
                      f"{med['at_once.tokens_per_second']:,.0f}",
                      f"{med['arrivals.ttft_p50']:.3f} / {med['arrivals.ttft_p90']:.3f} s",
                      f"{c['prompt_tokens_computed']:,}", f"{c['cached_tokens']:,}",
                      f"{c['peak_kv_blocks']:,} ({c['peak_kv_blocks'] * kv_bytes / 2**20:,.1f} MiB)")
    on, off = counts["caching on"], counts["caching off"]
    at_once, arriving = gains["at_once"], gains["arrivals"]
    table.add_row("gain", f"{at_once['ttft_p50']:.2f}× / {at_once['ttft_p90']:.2f}× sooner",
                  f"{at_once['tokens_per_second']:.2f}×",
                  f"{arriving['ttft_p50']:.2f}× / {arriving['ttft_p90']:.2f}× sooner",
                  f"{off['prompt_tokens_computed'] / on['prompt_tokens_computed']:.2f}× fewer", "",
                  f"{off['peak_kv_blocks'] / on['peak_kv_blocks']:.2f}× fewer")
    console.print(table)
    same = len({r["outputs_digest"] for name in SETTINGS for r in runs[name]["at_once"]}) == 1
    console.print(f"same tokens with and without the cache: {'✓' if same else '✗'}")
    return dict(workload=dict(name=work.name, requests=len(work.prompts), prefix_len=args.prefix, suffix=suffix,
                              output=OUTPUT, seed=args.seed, rate=args.rate,
                              prompt_lens=[len(p) for p in work.prompts], output_lens=work.output_lens),
                repeats=args.repeats, kv_bytes_per_block=kv_bytes, runs=runs, counts=counts,
                speedups=gains, same_tokens=same)


def sweep(model, args) -> tuple[dict, plots.Figure]:
    """A fixed prompt length, its first 0-90 % shared by every request."""
    length, results = args.sweep_prompt, {name: [] for name in SETTINGS}
    rows, gains = [], []
    with console.status(f"sweeping the shared share of a {length}-token prompt ..."):
        for share in args.shares:
            prefix = round(share * length)
            work = make_shared_prefix_workload(model.config.vocab_size, prefix, args.sweep_requests,
                                               (length - prefix, length - prefix), SWEEP_OUTPUT, args.seed)
            at_share = {name: [] for name in SETTINGS}
            for _, name, caching in interleaved(args.sweep_repeats):
                at_share[name].append(run_at_once(model, work, caching))
            for name, reps in at_share.items():
                row = {k: statistics.median(r[k] for r in reps) for k in ("ttft_p50", "ttft_p90", "tokens_per_second")}
                row |= {k: v for k, v in reps[0].items() if k not in row and k != "seconds"}
                results[name].append(row)
            gains.append(speedups(at_share["caching off"], at_share["caching on"]))
            rows.append((share, prefix))
    table = Table(title=f"{args.sweep_requests} requests of {length} prompt tokens, outputs {SWEEP_OUTPUT[0]}-"
                        f"{SWEEP_OUTPUT[1]}, all at once; median of {args.sweep_repeats}")
    for column in ("shared", "TTFT p50 off / on", "tok/s off / on", "prompt tokens computed off / on",
                   "peak KV blocks off / on"):
        table.add_column(column, justify="right")
    for i, (share, prefix) in enumerate(rows):
        on, off, gain = results["caching on"][i], results["caching off"][i], gains[i]
        table.add_row(f"{share:.0%} ({prefix} tok)",
                      f"{off['ttft_p50']:.3f} / {on['ttft_p50']:.3f} s ({gain['ttft_p50']:.2f}×)",
                      f"{off['tokens_per_second']:,.0f} / {on['tokens_per_second']:,.0f} "
                      f"({gain['tokens_per_second']:.2f}×)",
                      f"{off['prompt_tokens_computed']:,} / {on['prompt_tokens_computed']:,}",
                      f"{off['peak_kv_blocks']} / {on['peak_kv_blocks']}")
    console.print(table)
    title = (f"{args.sweep_requests} requests of {length} tokens whose first part is one shared system prompt, all "
             f"arriving at once; outputs {SWEEP_OUTPUT[0]}-{SWEEP_OUTPUT[1]} tokens\n{model.config.model_type} "
             f"{model.config.num_parameters() / 1e6:.1f}M, {device_name(model.device)}, "
             f"{str(model.dtype).removeprefix('torch.')}; timings: median over {args.sweep_repeats} side-by-side pairs")
    fig = plot_prefix_sweep(list(args.shares), results, gains, length, ENGINE["block_size"], title)
    return dict(prompt_len=length, requests=args.sweep_requests, output=SWEEP_OUTPUT, repeats=args.sweep_repeats,
                shares=list(args.shares), prefix_lens=[p for _, p in rows], results=results,
                speedups=gains), fig


def multi_turn(model, args) -> tuple[dict, plots.Figure]:
    """Chats turn by turn; each setting keeps one engine (and its cache) for the whole chat."""
    context = min(model.config.max_position_embeddings, 512)  # the embedded model's context, on every model
    chats = make_multi_turn_workload(model.config.vocab_size, args.conversations, args.turns,
                                     first=(context // 10, context // 5), message=(context // 64, context // 13),
                                     output=(context // 64, context // 13), seed=args.seed)
    console.print(f"[bold]workload[/] {chats.describe()}")
    size = ENGINE["block_size"]
    pool = 2 * args.conversations * -(-chats.longest_conversation // size)  # room to keep every turn cached
    turns: list[dict] = [dict(turn=t) for t in range(chats.num_turns)]
    ttfts: dict[tuple[int, str], list[float]] = {}  # (turn, setting) -> TTFT p50 of each repeat
    finals = []
    for r in range(args.chat_repeats):  # each repeat a whole chat on fresh engines
        llms = {name: fresh_llm(model, caching, pool) for name, caching in SETTINGS.items()}
        histories = {name: [[] for _ in chats.messages] for name in SETTINGS}
        for t in range(chats.num_turns):
            for name in list(SETTINGS) if (t + r) % 2 == 0 else list(SETTINGS)[::-1]:  # who goes first alternates
                prompts = chats.prompts(t, histories[name])
                turns[t] |= dict(prompt_tokens=sum(map(len, prompts)), history_lens=[len(h) for h in histories[name]])
                trace = llms[name].trace
                before = len(trace.steps)
                outs = llms[name].generate(prompts, [greedy(n[t]) for n in chats.output_lens], use_tqdm=False)
                ttfts.setdefault((t, name), []).append(
                    statistics.median(o.metrics.first_token_time - o.metrics.arrival_time for o in outs))
                histories[name] = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
                turns[t][name] = work_counts(trace, slice(before, None))  # the same in every repeat
        finals += histories.values()
    for t in turns:
        for name in SETTINGS:
            t[name]["ttft_p50"] = statistics.median(ttfts[t["turn"], name])
    same = all(h == finals[0] for h in finals)
    table = Table(title=f"{chats.describe()}\nprompt tokens computed per turn, and TTFT p50 (the turn's "
                        f"{args.conversations} requests arrive at once; median of {args.chat_repeats} repeats)")
    for column in ("turn", "prompt tokens", "computed off / on", "found in cache", "TTFT p50 off / on"):
        table.add_column(column, justify="right")
    for t in turns:
        on, off = t["caching on"], t["caching off"]
        table.add_row(str(t["turn"] + 1), f"{t['prompt_tokens']:,}",
                      f"{off['prompt_tokens_computed']:,} / {on['prompt_tokens_computed']:,}",
                      f"{on['cached_tokens']:,}", f"{off['ttft_p50']:.3f} / {on['ttft_p50']:.3f} s")
    console.print(table)
    console.print(f"same conversations with and without the cache: {'✓' if same else '✗'}")
    title = (f"{chats.describe()}\n{model.config.model_type} {model.config.num_parameters() / 1e6:.1f}M, "
             f"{device_name(model.device)}, {str(model.dtype).removeprefix('torch.')}; TTFT: median of "
             f"{args.chat_repeats} runs of the whole chat")
    fig = plot_multi_turn(turns, title)
    return dict(workload=dataclasses.asdict(chats) | dict(longest_conversation=chats.longest_conversation),
                block_size=size, num_kv_blocks=pool, repeats=args.chat_repeats, turns=turns, same_tokens=same), fig


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="requests of the shared-prefix benchmark")
    parser.add_argument("--prefix", type=int, default=200, help="tokens of its shared system prompt")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of caching on / off")
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals (requests/s) for the online TTFT")
    parser.add_argument("--shares", type=float, nargs="+", default=SHARES, help="shared shares of the prompt, 0-0.9")
    parser.add_argument("--sweep-prompt", type=int, default=256, help="prompt length of the sweep")
    parser.add_argument("--sweep-requests", type=int, default=16)
    parser.add_argument("--sweep-repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=8, help="chats of the multi-turn workload")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--chat-repeats", type=int, default=2, help="interleaved repeats of the whole chat")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("requests", "prefix", "repeats", "sweep_prompt", "sweep_requests", "sweep_repeats", "conversations",
                 "turns", "chat_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.rate <= 0:
        parser.error(f"--rate must be positive, got {args.rate}")
    if not all(0 <= s < 1 for s in args.shares):
        parser.error("--shares must lie in [0, 1): every request keeps some tokens of its own")
    model = load_for_chapter(args)
    context = model.config.max_position_embeddings
    if 2 * args.prefix + OUTPUT[1] > context or args.sweep_prompt + SWEEP_OUTPUT[1] > context:
        parser.error(f"--prefix {args.prefix} (prompts up to {2 * args.prefix} tokens, answers up to {OUTPUT[1]}) "
                     f"and --sweep-prompt {args.sweep_prompt} must fit the model's context of {context} tokens")
    tokenizer = load_tokenizer(args.model)
    suffix = "" if model.device.type == "cpu" else f"_{model.device.type}"
    start = time.perf_counter()

    facts = dict(sample=sample(model, tokenizer))
    facts["shared_blocks"], fig = shared_blocks(model)
    console.print(f"saved {plots.save(fig, '11_shared_blocks')}")
    facts["n_completions"] = n_completions(model)
    facts["headline"] = headline(model, args)
    facts["sweep"], fig = sweep(model, args)
    console.print(f"saved {plots.save(fig, '11_shared_prefix' + suffix)}")
    facts["multi_turn"], fig = multi_turn(model, args)
    console.print(f"saved {plots.save(fig, '11_multi_turn' + suffix)}")
    path = save_results(f"11_prefix_caching_{model.device.type}", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"), engine=ENGINE,
        load_average=list(os.getloadavg()), seconds=time.perf_counter() - start, **facts))
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
