"""Chapter 12 — speculative decoding: guess several tokens cheaply, verify them in one forward pass.

    python chapters/12_speculative_decoding.py [--model SRC] [--draft SRC] [--device cpu|cuda] [--k 4]
                                               [--repeats 3] [--threads N] [--prompt-tokens 300] [--output-tokens 200]
                                               [--ks 1 2 3 4 5] [--batches 1 2 4 8 16 32 64]

On a GPU (the Qwen3-0.6B shape, random weights: only the verify-step cost means anything there):
    python chapters/12_speculative_decoding.py --device cuda --model minivllm/configs/qwen3-0.6b.json
The GPU runbook's part (course.bench.speculation.gpu_runbook: verify / decode with both replayed from
graphs and the eager verify beside them, on that shape; then the embedded model's n-gram speed-up
at batch 1, fp32, tokens checked identical; JSON 12_speculative_decoding_runbook_cuda.json, figure
12_verify_graphs_cuda.png). On a CPU the same command is a dry run (EagerGraph, small sizes):
    python chapters/12_speculative_decoding.py --device cuda --model minivllm/configs/qwen3-0.6b.json --runbook

- a sample: the embedded model continues repetitive code with prompt lookup, same text as without;
- one verify step drawn token by token, with its ragged batch and its rollback (figures/12_verify_step.png);
- acceptance and tokens per target forward against k, prompt lookup and the draft model, on
  repetitive and on ordinary code (figures/12_acceptance.png);
- the benchmark: batch 1, a ~300-token prompt of repetitive code, 200 tokens, plain decoding
  against each proposer side by side, tokens checked identical;
- the speed-up against batch size: where speculation stops paying (figures/12_speedup_vs_batch.png);
- what a verify step of k + 1 tokens per sequence costs against a decode step, by batch size
  (figures/12_verify_cost.png): the reason for the crossover.
JSON: benchmarks/results/12_speculative_decoding_<device>.json.
"""
from __future__ import annotations

import time

import torch
from rich.table import Table

from minivllm import DRAFT_MODEL, LLM, EngineConfig, load_model, load_tokenizer
from minivllm.course import plots
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.course.bench.speculation import (acceptance_sweep, batch_sweep, code_prompts, gpu_runbook, greedy,
                                        method_config, run_generation, verify_cost)
from minivllm.core.trace import Trace
from minivllm.machine import device_name, environment
from minivllm.course.plots.lines import plot_series
from minivllm.course.plots.speculation import VerifiedRow, plot_acceptance_vs_k, plot_speedup_vs_batch, plot_verify_step
from minivllm.course.text import show_sample

SWEEP_PROMPTS = 4  # prompts of each kind of code in the sweeps


def sample(model, tokenizer, draft, k: int) -> None:
    prompt = code_prompts(tokenizer, "repetitive", 1, 200)[0]
    plain = LLM(model, tokenizer=tokenizer).generate([prompt], greedy(60), use_tqdm=False)[0]
    llm = LLM(model, tokenizer=tokenizer, speculative_config=method_config("ngram", k))
    out = llm.generate([prompt], greedy(60), use_tqdm=False)[0]
    show_sample(tokenizer, prompt[-60:], out.outputs[0].token_ids, f"prompt lookup, k = {k}")
    console.print(f"same tokens as without speculation: {out.outputs[0].token_ids == plain.outputs[0].token_ids}; "
                  f"{out.metrics.num_accepted_tokens} of {out.metrics.num_draft_tokens} guesses kept")


def one_step(model, tokenizer, draft, k: int) -> list[VerifiedRow]:
    """Run three requests with the draft model until a step verifies guesses for two of them and
    its rollback gives a block back; that step, read back from the trace and the step's outputs."""
    prompts = code_prompts(tokenizer, "repetitive", 2, 120) + code_prompts(tokenizer, "ordinary", 1, 120)
    llm = LLM(model, tokenizer=tokenizer, block_size=2, speculative_config=method_config("draft", k, draft))
    engine, decode = llm.engine, lambda t: repr(tokenizer.decode([t]))[1:-1] or "·"
    engine.core.trace = Trace()
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt=prompt, params=greedy(40), request_id=f"request {i}")
    while engine.has_unfinished_requests():
        before = {s.request_id: (s.num_computed_tokens, s.token_ids[-1]) for s in engine.core.scheduler.running}
        outputs = {o.request_id: o.outputs[0].token_ids for o in engine.step()}
        record, size = engine.core.trace.steps[-1], engine.config.block_size
        frees = any(-(-(before[r][0] + 1 + len(g)) // size) > -(-(before[r][0] + 1 + record.accepted[r]) // size)
                    for r, g in record.drafts.items())
        if len(record.drafts) >= 2 and frees:
            return [VerifiedRow(rid, before[rid][0], decode(before[rid][1]), [decode(t) for t in guesses],
                                record.accepted[rid], decode(outputs[rid][-1]), engine.config.block_size)
                    for rid, guesses in record.drafts.items()]
    raise RuntimeError("no step verified guesses for two requests and gave a block back")


def benchmark(model, tokenizer, draft, k: int, repeats: int, prompt_tokens: int, output_tokens: int) -> dict:
    prompt = code_prompts(tokenizer, "repetitive", 1, prompt_tokens)
    params = greedy(output_tokens)
    plain = run_generation(LLM(model, tokenizer=tokenizer), prompt, params, repeats)
    rows = {"plain decoding": plain}
    for method in ("ngram", "draft"):
        rows[method] = run_generation(LLM(model, tokenizer=tokenizer, speculative_config=method_config(method, k, draft)),
                                      prompt, params, repeats)
    table = Table(title=f"Batch 1, {len(prompt[0])}-token prompt of repetitive code, {output_tokens} tokens, greedy, k = {k}\n"
                        f"{device_name(model.device)}, {str(model.dtype).removeprefix('torch.')}, "
                        f"{model.config.num_parameters() / 1e6:.1f}M-parameter {model.config.model_type}, best of {repeats}")
    for column in ("", "tokens/s", "speed-up", "guesses kept", "same tokens"):
        table.add_column(column, justify="left" if not column else "right")
    for name, row in rows.items():
        table.add_row(name, f"{row['tokens_per_second']:,.0f}", f"{row['tokens_per_second'] / plain['tokens_per_second']:.2f}×",
                      "—" if row["acceptance"] is None else f"{row['acceptance']:.0%}",
                      "✓" if row["tokens"] == plain["tokens"] else "✗")
    console.print(table)
    return {name: {key: value for key, value in row.items() if key != "tokens"} | dict(same_tokens=row["tokens"] == plain["tokens"])
            for name, row in rows.items()}


def verify_costs(model, k: int, batches: list[int]) -> tuple[list[dict], plots.Figure]:
    on_gpu = model.device.type == "cuda"
    sizes = [1, 4, 16, 64, 128, 256] if on_gpu else batches
    context = 600 if on_gpu else 120
    config = EngineConfig(max_num_seqs=max(sizes), num_kv_blocks=max(sizes) * (-(-(context + 16) // 16))).resolve(model)
    rows = verify_cost(model, config, sizes, k, context)
    fig, ax = plots.plt.subplots(figsize=(7, 4))
    plot_series(ax, sizes, {"decode step (1 token per sequence)": [1e3 * r["decode_seconds"] for r in rows],
                            f"verify step ({k + 1} tokens per sequence)": [1e3 * r["verify_seconds"] for r in rows]},
                "sequences in the step", "ms per step (median)",
                f"What verifying {k} guesses costs, contexts ~{context} tokens\n{device_name(model.device)}, "
                f"{model.config.model_type} {model.config.num_parameters() / 1e6:.0f}M", logy=True)
    ax.set_xscale("log", base=2)
    table = Table(title=f"A verify step of {k + 1} tokens per sequence against a decode step")
    for column in ("sequences", "decode ms", "verify ms", "verify / decode"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["batch_size"]), f"{1e3 * r['decode_seconds']:.2f}", f"{1e3 * r['verify_seconds']:.2f}",
                      f"{r['ratio']:.2f}×")
    console.print(table)
    return rows, fig


def runbook(args) -> None:
    """The GPU runbook's part: course.bench.speculation.gpu_runbook, its tables, its figure and JSON."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device == "cuda"
    sizes = [1, 4, 16, 64, 128, 256] if on_gpu else args.batches
    with console.status("chapter 12 on the device: verify steps in graphs, then the embedded model at batch 1"):
        result = gpu_runbook(device, args.model, args.k, sizes, 600 if on_gpu else 120, args.prompt_tokens,
                             args.output_tokens, args.repeats, graphs=None if on_gpu else True)
    shape, rows = result["verify_cost_model"], result["verify_cost"]
    where = f"{device_name(torch.device(device))}, {shape['shape']} {shape['parameters'] / 1e6:.0f}M, {shape['dtype']}"
    table = Table(title=f"A verify step of {args.k + 1} tokens per sequence against a decode step\n{where}")
    for column in ("sequences", "decode ms", "verify ms", "verify / decode", "eager verify ms", "eager / decode"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["batch_size"]), f"{1e3 * r['decode_seconds']:.2f}", f"{1e3 * r['verify_seconds']:.2f}",
                      f"{r['ratio']:.2f}×", f"{1e3 * r['eager_verify_seconds']:.2f}", f"{r['eager_ratio']:.2f}×")
    console.print(table)
    e2e, padding = result["end_to_end"], result["padding"]
    console.print(f"embedded model, {e2e['workload']}, fp32: plain {e2e['plain']['tokens_per_second']:,.0f} tok/s, "
                  f"n-gram (k = {args.k}) {e2e['ngram']['tokens_per_second']:,.0f} tok/s: {e2e['speedup']:.2f}×, "
                  f"same tokens: {e2e['same_tokens']}, {e2e['tokens_per_verify']:.2f} tokens per verify step")
    console.print(f"verify steps: {padding['verify_steps']}, decode steps {padding['decode_steps']}, eager "
                  f"{padding['eager_steps']}; padding {padding['padding_share']:.0%} of the verify graphs' rows "
                  f"({padding['short_guess_share']:.0%} from fewer than k guesses)")
    console.print(f"disable_by_batch_size by the rule (gain < 1.1×): {result['disable_by_batch_size']}")
    fig, ax = plots.plt.subplots(figsize=(7, 4))
    series = {"decode step (graph)": "decode_seconds",
              f"verify step, {args.k + 1} tokens a sequence (graph)": "verify_seconds",
              "verify step, eager (before)": "eager_verify_seconds"}
    plot_series(ax, sizes, {label: [1e3 * r[key] for r in rows] for label, key in series.items()}, "sequences in the step",
                "ms per step (median)", f"Verify steps replayed from graphs\n{where}", logy=True)
    ax.set_xscale("log", base=2)
    console.print(f"saved {plots.save(fig, f'12_verify_graphs_{device}')}")
    result["created"] = time.strftime("%Y-%m-%d %H:%M:%S")
    console.print(f"saved {save_results(f'12_speculative_decoding_runbook_{device}', result)}")


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[1])
    parser.add_argument("--draft", default=None, help="the draft model (default: the embedded draft, for the embedded model)")
    parser.add_argument("--k", type=int, default=4, help="guesses per step in the benchmark and the sweeps")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per setting (the best counts)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--prompt-tokens", type=int, default=300, help="the benchmark's prompt (the context is 512)")
    parser.add_argument("--output-tokens", type=int, default=200, help="tokens the benchmark's request generates")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="k in the acceptance sweep")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="batch sizes swept")
    parser.add_argument("--runbook", action="store_true", help="only the GPU runbook's part (see above)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.runbook:
        return runbook(args)
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)
    results = dict(environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"), k=args.k)
    if tokenizer is not None:
        draft = load_model(args.draft or DRAFT_MODEL, device=str(model.device), dtype=model.dtype)
        subtitle = (f"{model.config.model_type} {model.config.num_parameters() / 1e6:.1f}M, draft "
                    f"{draft.config.num_parameters() / 1e6:.1f}M, {device_name(model.device)}, "
                    f"{str(model.dtype).removeprefix('torch.')}, greedy")
        sample(model, tokenizer, draft, args.k)
        console.print(f"saved {plots.save(plot_verify_step(one_step(model, tokenizer, draft, 3)), '12_verify_step')}")
        prompts = {kind: code_prompts(tokenizer, kind, SWEEP_PROMPTS, args.prompt_tokens) for kind in ("repetitive", "ordinary")}
        with console.status("acceptance against k"):
            results["acceptance"] = acceptance_sweep(model, tokenizer, draft, prompts, args.ks, args.output_tokens // 2)
        console.print(f"saved {plots.save(plot_acceptance_vs_k(results['acceptance'], subtitle), '12_acceptance')}")
        results["benchmark"] = benchmark(model, tokenizer, draft, args.k, args.repeats, args.prompt_tokens,
                                         args.output_tokens)
        with console.status("speed-up against batch size"):
            results["batch_sweep"] = batch_sweep(model, tokenizer, draft, prompts["repetitive"], args.batches, args.k,
                                                 args.output_tokens // 3, args.repeats)
        console.print(f"saved {plots.save(plot_speedup_vs_batch(results['batch_sweep'], subtitle + ', repetitive code'), '12_speedup_vs_batch')}")
    else:
        console.print("[yellow]this model has no tokenizer (a config-only shape): only the verify-step cost is measured")
    results["verify_cost"], fig = verify_costs(model, args.k, args.batches)
    console.print(f"saved {plots.save(fig, '12_verify_cost')}")
    console.print(f"saved {save_results(f'12_speculative_decoding_{model.device.type}', results)}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
