"""minivllm's engine against what a user would otherwise reach for, side by side in one run.

    python benchmarks/continuous_vs_transformers.py [--model SRC] [--device cpu|cuda] [--threads N] [--repeats 3]

Same model weights, same prompts, same output lengths (greedy, EOS ignored), timed in turns:
- minivllm: LLM.generate, default settings (continuous batching, paged KV cache);
- transformers static batching: `model.generate` on consecutive padded batches of 16 (left
  padding, max_new_tokens = the batch's longest output); only each request's own tokens count;
- transformers continuous batching: the manager behind `model.generate_batch`, each request
  with its own max_new_tokens (generate_batch itself takes one length for all), KV cache sized
  to hold every request (see minivllm/peers.py).
Writes benchmarks/results/07_vs_transformers_<device>.json and figures/07_vs_transformers.png.
"""
from __future__ import annotations

import statistics
import time

import torch

from minivllm import LLM, SamplingParams, plots
from minivllm.bench import (
    chapter_parser,
    console,
    environment,
    format_tokens_per_second,
    load_for_chapter,
    make_workload,
    save_results,
)
from minivllm.peers import hf_generate_batch, hf_static_generate, to_transformers, token_positions
from minivllm.plots.lines import plot_bars

OURS, STATIC, CONTINUOUS = "minivllm LLM.generate", "transformers generate (static)", "transformers generate_batch"
NOTES = {
    OURS: "continuous batching, paged KV (default settings)",
    STATIC: "left-padded batches, each run to its longest output; useful tokens only",
    CONTINUOUS: "continuous batching manager, per-request max_new_tokens, cache sized to the workload",
}


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--workload", default="classroom")
    parser.add_argument("--requests", type=int, default=None, help="default: the workload's own count")
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size of the transformers peer")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each, interleaved; the median counts")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_for_chapter(args)
    hf_model = to_transformers(model)
    work = make_workload(args.workload, model.config.vocab_size, seed=args.seed, num_requests=args.requests)
    console.print(f"[bold]workload[/] {work.describe()}")

    llm = LLM(model)

    def minivllm_generate(prompts: list[list[int]], lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]
        return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    runners = {
        OURS: minivllm_generate,
        STATIC: lambda prompts, lens: hf_static_generate(hf_model, prompts, lens, args.batch_size),
        CONTINUOUS: lambda prompts, lens: hf_generate_batch(hf_model, prompts, lens),
    }
    for run in runners.values():  # warm-up: first calls pay for allocation and kernel caches
        run(work.prompts[:2], [4, 4])
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        for name, run in runners.items():
            with console.status(f"run {repeat + 1}/{args.repeats}: {name}"):
                start = time.perf_counter()
                outputs[name] = run(work.prompts, work.output_lens)
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds[name].append(time.perf_counter() - start)

    needed, padded = token_positions(work.prompts, work.output_lens, args.batch_size)
    work_done = {OURS: needed, STATIC: padded, CONTINUOUS: needed}
    rows = []
    for name in runners:
        median = statistics.median(seconds[name])
        useful = sum(min(len(o), n) for o, n in zip(outputs[name], work.output_lens))
        same = sum(a == b for a, b in zip(outputs[name], outputs[OURS]))
        rows.append(dict(name=name, seconds=seconds[name], median_seconds=median, useful_tokens=useful,
                         tokens_per_second=useful / median, same_tokens_as_minivllm=f"{same}/{len(work.prompts)}",
                         token_positions_computed=work_done[name], note=NOTES[name]))
    base = rows[0]["tokens_per_second"]
    for row in rows:
        row["minivllm_speedup_over_this"] = base / row["tokens_per_second"]
        console.print(f"{row['name']:42s} {format_tokens_per_second(row['tokens_per_second']):>8s} tok/s  "
                      f"(median of {args.repeats}: {row['median_seconds']:.2f} s)  minivllm is "
                      f"{row['minivllm_speedup_over_this']:.2f}× this  same tokens: {row['same_tokens_as_minivllm']}  "
                      f"token positions computed: {row['token_positions_computed']:,}")

    env = environment(model)
    payload = dict(environment=env, static_batch_size=args.batch_size, workload=dict(name=work.name, description=work.describe(), seed=args.seed,
                   prompt_lens=[len(p) for p in work.prompts], output_lens=work.output_lens), rows=rows,
                   created=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = save_results(f"07_vs_transformers_{model.device.type}", payload)
    fig = plot_bars(
        [r["name"].replace(" (static)", f"\n(static, batch {args.batch_size})") for r in rows], [r["tokens_per_second"] for r in rows], "useful output tokens / s",
        "minivllm vs transformers on the same workload",
        annotations=[f"{format_tokens_per_second(r['tokens_per_second'])} tok/s"
                     + ("" if r["name"] == OURS else f"\nminivllm is {r['minivllm_speedup_over_this']:.2f}× this")
                     for r in rows],
        colors=["#2b6cb0", "#dd6b20", "#dd6b20"],
        subtitle=f"{work.describe()}\n{env['model']['model_type']} {env['model']['parameters'] / 1e6:.1f}M params, "
                 f"{env['device']}, {env['dtype']}, median of {args.repeats}",
    )
    fig.axes[0].set_ylim(top=1.2 * max(r["tokens_per_second"] for r in rows))  # room for the labels
    console.print(f"saved {path} and {plots.save(fig, '07_vs_transformers')}")


if __name__ == "__main__":
    main()
