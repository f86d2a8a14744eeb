"""Chapter 7 — continuous batching: the scheduler and the finished engine.

    python chapters/07_continuous_batching.py [--model SRC] [--device cpu|cuda] [--rates 1 2 4 8 16]

Shows a sample through `LLM`, then serves requests arriving as a Poisson process:
- a small run under a tight KV pool and token budget, recorded step by step: who waited,
  prefilled (in chunks), decoded, was preempted (figures/07_timeline.png), and what each step
  was made of against the budget (figures/07_step_composition.png);
- continuous vs static batching on the same arrivals and the same engine at several request
  rates: TTFT, TPOT, ITL and end-to-end latency at p50/p90/p99, and useful throughput
  (figures/07_latency_vs_rate.png, benchmarks/results/07_continuous_batching.json).
Every engine here is chapter 7's: prefix caching, chapter 11's, is off.
"""
from __future__ import annotations

import torch
from rich.table import Table

from minivllm import LLM, LLMEngine, SamplingParams, load_tokenizer
from minivllm.course import plots
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.course.bench.online import latency_summary, serve_continuous, serve_static
from minivllm.course.bench.workloads import make_workload
from minivllm.core.trace import PREEMPTED, TIMELINE_LABELS, Trace
from minivllm.machine import environment
from minivllm.course.plots.scheduling import plot_latency_vs_rate, plot_step_composition, plot_timeline
from minivllm.course.text import DEMO_PROMPT, encode_or_random, show_sample

# The traced run: a pool too small for everyone admitted to grow at once, so the newest
# running request is preempted now and then (3 times with the default seed).
TIMELINE_ENGINE = dict(block_size=16, num_kv_blocks=32, max_num_batched_tokens=128, max_num_seqs=8,
                       enable_prefix_caching=False)
ARRIVAL_GAP = 8  # engine steps between arrivals, on average

STATIC_EXPLAINED = (
    "Static batching here runs on the same engine: when free, it takes the requests that have arrived (up to "
    "--batch-size) and runs them until the longest is done; later arrivals wait. A request's tokens count when they "
    "are produced (as if streamed), not when its batch ends, so static batching is shown at its kindest."
)


def sample(model: torch.nn.Module, tokenizer) -> None:
    llm = LLM(model, tokenizer=tokenizer, enable_prefix_caching=False)
    prompt = encode_or_random(tokenizer, DEMO_PROMPT, model.config.vocab_size)
    greedy, sampled = llm.generate([prompt, prompt], [SamplingParams(max_tokens=40, temperature=0),
                                                      SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=0)],
                                   use_tqdm=False)
    show_sample(tokenizer, prompt, greedy.outputs[0].token_ids, "LLM.generate")
    text = sampled.outputs[0].text or " ".join(map(str, sampled.outputs[0].token_ids))
    console.print(f"[bold]sampled[/] (temperature 0.8, top-p 0.95, seed 0): {text!r}")


def timeline(model: torch.nn.Module, args) -> dict:
    """A short run under starvation, traced, drawn as two pictures. Requests arrive at engine
    steps, not seconds (a Poisson process with one arrival every ARRIVAL_GAP steps on average),
    so the schedule, and its preemptions, are the same on every machine."""
    work = make_workload("classroom", model.config.vocab_size, seed=args.seed, num_requests=12, rate=1 / ARRIVAL_GAP)
    arrival_step = [round(a) for a in work.arrivals]
    engine = LLMEngine(model, **TIMELINE_ENGINE)
    engine.core.trace = trace = Trace()
    pending, step = list(range(len(work.prompts))), 0  # arrivals are in order
    while pending or engine.has_unfinished_requests():
        while pending and arrival_step[pending[0]] <= step:
            i = pending.pop(0)
            params = SamplingParams(max_tokens=work.output_lens[i], temperature=0.0, ignore_eos=True)
            engine.add_request(prompt=work.prompts[i], params=params, request_id=str(i))
        engine.step()  # with nothing to run (before the next arrival) it records nothing
        step += 1
    steps = trace.steps
    prefill_steps: dict[str, int] = {}
    for s in steps:
        for rid in s.prefill:
            prefill_steps[rid] = prefill_steps.get(rid, 0) + 1
    settings = TIMELINE_ENGINE
    title = (f"{len(work.prompts)} classroom requests, one every {ARRIVAL_GAP} steps on average; "
             f"{settings['num_kv_blocks']} blocks × {settings['block_size']} tokens, budget "
             f"{settings['max_num_batched_tokens']} tokens/step, at most {settings['max_num_seqs']} running: "
             f"{len(steps)} steps, {trace.num_preemptions} preemptions")
    ids, grid = trace.timeline()
    fig = plot_timeline(ids, grid, TIMELINE_LABELS, title, marked=PREEMPTED)
    console.print(f"saved {plots.save(fig, '07_timeline')}")
    fig = plot_step_composition([s.num_prefill_tokens for s in steps], [len(s.decode) for s in steps],
                                settings["max_num_batched_tokens"],
                                "Each step: decodes first, then prefill chunks fill the budget")
    console.print(f"saved {plots.save(fig, '07_step_composition')}")
    return dict(steps=len(steps), preemptions=trace.num_preemptions,
                steps_using_whole_budget=sum(1 for s in steps if s.num_tokens == s.budget),
                prompts_over_several_steps=sum(1 for n in prefill_steps.values() if n > 1),
                recomputed_tokens=sum(s.recomputed for s in steps))


def latency_table(rate: float, results: dict[str, dict]) -> Table:
    table = Table(title=f"Poisson arrivals at {rate} requests/s (seconds; p50 / p90 / p99)")
    table.add_column("policy")
    for metric in ("TTFT", "TPOT", "ITL", "E2E"):
        table.add_column(metric, justify="right")
    table.add_column("useful tok/s", justify="right")
    for policy, s in results.items():
        cells = [" / ".join(f"{s[m][p]:.3f}" for p in ("p50", "p90", "p99")) for m in ("ttft", "tpot", "itl", "e2e")]
        table.add_row(policy, *cells, f"{s['throughput']['useful_tokens_per_second']:,.0f}")
    return table


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, 16.0], help="requests per second")
    parser.add_argument("--requests", type=int, default=32, help="requests per simulated run")
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size, and the engine's max_num_seqs")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the engine")
    args = parser.parse_args()
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)

    sample(model, tokenizer)
    trace_facts = timeline(model, args)
    console.print(f"timeline run: {trace_facts}")

    engine = LLMEngine(model, max_num_batched_tokens=args.budget, max_num_seqs=args.batch_size,
                       enable_prefix_caching=False)
    serve_continuous(engine, make_workload("tiny", model.config.vocab_size, rate=100.0))  # warm-up
    console.print(STATIC_EXPLAINED)
    results: dict[str, list[dict]] = {"continuous": [], "static": []}
    for rate in args.rates:
        work = make_workload("classroom", model.config.vocab_size, seed=args.seed, num_requests=args.requests, rate=rate)
        with console.status(f"serving {len(work.prompts)} requests at {rate} req/s, continuous then static..."):
            at_rate = {"continuous": latency_summary(serve_continuous(engine, work)),
                       "static": latency_summary(serve_static(engine, work, args.batch_size))}
        for policy, summary in at_rate.items():
            results[policy].append(summary)
        console.print(latency_table(rate, at_rate))
    title = (f"Continuous vs static batching (batch {args.batch_size}), classroom workload, {args.requests} requests\n"
             f"{model.config.model_type} {model.config.num_parameters() / 1e6:.1f}M, {environment(model)['device']}")
    console.print(f"saved {plots.save(plot_latency_vs_rate(args.rates, results, title), '07_latency_vs_rate')}")
    path = save_results("07_continuous_batching", dict(
        environment=environment(model), workload=dict(name="classroom", requests=args.requests, seed=args.seed),
        engine=dict(max_num_batched_tokens=args.budget, max_num_seqs=args.batch_size, static_batch_size=args.batch_size),
        static_semantics=STATIC_EXPLAINED, rates=args.rates, latency=results, timeline=trace_facts))
    console.print(f"saved {path}")


if __name__ == "__main__":
    main()
