"""Chapter 13 — structured outputs: the sampler never sees a token that would break the format.

    python chapters/13_structured_outputs.py [--model SRC] [--device cpu|cuda] [--samples 4] [--max-tokens 128]
                                             [--batch-sizes 1 2 4 8 16 32 64] [--steps 32] [--repeats 3] [--threads N]

On a GPU (the Qwen3-0.6B shape, random weights, bf16; its grammars are built on the embedded
tokenizer, whose 4,096 tokens are the first of the model's 151,936):
    python chapters/13_structured_outputs.py --device cuda --model minivllm/configs/qwen3-0.6b.json \
        --batch-sizes 1 4 16 64 256

- a sample: one prompt under a JSON schema and under a list of choices, and what each constraint
  costs to compile (once; a background thread does it while the batch keeps running);
- the bitmask over the whole vocabulary, step by step, while a JSON object is generated
  (figures/13_bitmask_steps.png);
- how often the same requests fit a format without the mask and with it
  (figures/13_validity.png);
- free whitespace in JSON: how much constrained JSON finishes within --max-tokens with and
  without it, greedy and sampled (figures/13_whitespace.png): why the engine disables it;
- the benchmark: a decode step with and without every row under a JSON schema, and the mask's
  own parts, against the batch size, repeats interleaved (figures/13_mask_cost.png).
JSON: benchmarks/results/13_structured_outputs_<device>.json.
"""
from __future__ import annotations

import os
import time

import torch
from rich.markup import escape
from rich.table import Table

from minivllm import LLM, SamplingParams, StructuredOutputsParams, load_tokenizer
from minivllm.course import plots
from minivllm.course.bench import structured
from minivllm.course.bench.harness import chapter_parser, console, load_for_chapter, save_results
from minivllm.machine import device_name, environment
from minivllm.course.plots.structured import plot_bitmask_steps, plot_finish_rates, plot_mask_cost, plot_validity

PICTURE_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "admin": {"type": "boolean"}},
                  "required": ["name", "admin"]}


def describe(model, llm: LLM) -> str:
    """Model, device, dtype and the whitespace rule, for every table and figure."""
    return (f"{model.config.model_type} {model.config.num_parameters() / 1e6:.1f}M, vocabulary "
            f"{model.config.vocab_size:,}, {device_name(model.device)}, {str(model.dtype).removeprefix('torch.')}")


def sample(llm: LLM) -> dict:
    prompt = structured.JSON_PROMPTS[0]
    table = Table(title=escape(f"One prompt, {prompt!r}, greedy, under three constraints"))
    for column in ("constraint", "output", "finish", "compiled in"):
        table.add_column(column)
    constraints = {"JSON schema (user)": structured.FORMATS["JSON schema (user)"],
                   "choice: True / False / None": structured.FORMATS["choice: True / False / None"],
                   "none": None}
    compiled = structured.compile_seconds(llm, {k: v for k, v in constraints.items() if v is not None})
    outputs = {}
    for name, constraint in constraints.items():
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, structured_outputs=constraint),
                           use_tqdm=False)[0].outputs[0]
        outputs[name] = dict(text=out.text, finish_reason=out.finish_reason)
        table.add_row(escape(name), escape(repr(out.text)), out.finish_reason,
                      f"{1e3 * compiled[name]:.1f} ms" if name in compiled else "—")
    console.print(table)
    return dict(prompt=prompt, outputs=outputs, compile_seconds=compiled)


def bitmask_picture(model, llm: LLM) -> tuple[dict, plots.Figure]:
    constraint = StructuredOutputsParams(json=PICTURE_SCHEMA)
    steps = structured.bitmask_steps(llm, structured.JSON_PROMPTS[1], constraint, 48)
    title = (f"The grammar's bitmask, step by step, while a JSON object is generated greedily "
             f"(schema: name: string, admin: boolean)\n{structured.JSON_PROMPTS[1]!r} → {steps['text']!r}; "
             f"{describe(model, llm)}")
    fig = plot_bitmask_steps(steps["allowed"], steps["tokens"], steps["labels"], title)
    counts = steps["allowed"].sum(dim=1).tolist()
    console.print(f"[bold]bitmask[/]: {len(counts)} steps; tokens allowed per step from {min(counts):,} to "
                  f"{max(counts):,} of {model.config.vocab_size:,} (inside a string, almost all; between keys, a few)")
    return dict(text=steps["text"], tokens=steps["tokens"], allowed_per_step=counts), fig


def validity(model, llm: LLM, args) -> tuple[dict, plots.Figure]:
    with console.status("the same requests without and with the mask ..."):
        counts = structured.validity(llm, structured.JSON_PROMPTS, structured.FORMATS, args.max_tokens, args.samples,
                                     args.seed)
    table = Table(title=f"{len(structured.JSON_PROMPTS)} prompts × (1 greedy + {args.samples} sampled), "
                        f"max_tokens {args.max_tokens}")
    for column in ("format", "fits, no mask", "fits, with the mask", "cut by max_tokens", "breaks it, with the mask"):
        table.add_column(column, justify="left" if column == "format" else "right")
    for name, modes in counts.items():
        free, held = modes["unconstrained"], modes["constrained"]
        n = sum(held.values())
        table.add_row(escape(name), f"{free['valid']}/{n}", f"{held['valid']}/{n}", f"{held['cut']}/{n}",
                      f"{held['invalid']}/{n}")
    console.print(table)
    title = (f"Does the output fit the format? The same {sum(counts[next(iter(counts))]['constrained'].values())} "
             f"requests per format (prompts asking, in Python, for a value; greedy and sampled), without and with "
             f"the mask\nwithout it, an output counts if its first JSON value (or first line) fits; "
             f"max_tokens {args.max_tokens}; {describe(model, llm)}")
    return counts, plot_validity(counts, title)


def whitespace(model, llm: LLM, args) -> tuple[dict, plots.Figure]:
    with console.status("constrained JSON with and without free whitespace ..."):
        rates = structured.finish_rates(llm, structured.JSON_PROMPTS, structured.SCHEMAS, args.max_tokens,
                                        args.samples, args.seed)
    table = Table(title=f"{len(structured.SCHEMAS)} JSON schemas × {len(structured.JSON_PROMPTS)} prompts, "
                        f"max_tokens {args.max_tokens}: how much constrained JSON finishes")
    for column in ("", "finished", "of those, fit the schema", "mean output tokens", "first output"):
        table.add_column(column, justify="left" if column in ("", "first output") else "right")
    for label, r in rates.items():
        table.add_row(label, f"{r['finished']}/{r['requests']} ({r['finished'] / r['requests']:.0%})",
                      f"{r['fits']}/{r['finished']}", f"{r['mean_tokens']:.0f}", escape(repr(r["example"][:60])))
    console.print(table)
    title = (f"Constrained JSON with free whitespace (xgrammar's and vLLM's default) and without it (minivllm's "
             f"default): {len(structured.SCHEMAS)} schemas × {len(structured.JSON_PROMPTS)} prompts, greedy and "
             f"{args.samples} sampled each\nmax_tokens {args.max_tokens}; {describe(model, llm)}")
    return rates, plot_finish_rates(rates, title)


def mask_cost(model, llm: LLM, args) -> tuple[list, plots.Figure]:
    with console.status(f"decode steps with and without the mask at batch sizes {args.batch_sizes} ..."):
        rows = structured.masking_cost(llm, args.batch_sizes, args.steps, args.repeats, args.seed)
    table = Table(title=f"A decode step, median of {args.steps} steps × {args.repeats} interleaved repeats; "
                        f"the mask's parts replayed along the constrained outputs")
    for column in ("batch", "no constraint", "under a JSON schema", "fill", "apply", "advance", "mask / step"):
        table.add_column(column, justify="right")
    for r in rows:
        parts = r["fill_us"] + r["apply_us"] + r["advance_us"]
        table.add_row(str(r["batch_size"]), f"{r['plain_step_ms']:.2f} ms", f"{r['constrained_step_ms']:.2f} ms",
                      f"{r['fill_us']:.0f} µs", f"{r['apply_us']:.0f} µs", f"{r['advance_us']:.0f} µs",
                      f"{parts / (10 * r['plain_step_ms']):.1f}%")
    console.print(table)
    title = (f"What the mask costs per decode step: every row under a JSON schema (an array of at least 16 objects, "
             f"so no request ends early), sampled; {args.steps} steps × {args.repeats} interleaved repeats\n"
             f"{describe(model, llm)}")
    return rows, plot_mask_cost(rows, title)


def main() -> None:
    parser = chapter_parser(__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4, help="sampled requests per prompt (beside one greedy)")
    parser.add_argument("--max-tokens", type=int, default=128, help="of every constrained request")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per batch size and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the masking benchmark")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in ("samples", "max_tokens", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must be at least 1")
    model = load_for_chapter(args)
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        tokenizer = load_tokenizer()
        console.print(f"[bold]tokenizer[/] the checkpoint has none: the embedded model's ({len(tokenizer):,} tokens) "
                      f"stands in, its ids the first of the model's {model.config.vocab_size:,}")
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=max(256, max(args.batch_sizes)))
    suffix = "" if model.device.type == "cpu" else f"_{model.device.type}"
    start = time.perf_counter()

    facts = dict(sample=sample(llm))
    facts["bitmask"], fig = bitmask_picture(model, llm)
    console.print(f"saved {plots.save(fig, '13_bitmask_steps' + suffix)}")
    facts["validity"], fig = validity(model, llm, args)
    console.print(f"saved {plots.save(fig, '13_validity' + suffix)}")
    facts["whitespace"], fig = whitespace(model, llm, args)
    console.print(f"saved {plots.save(fig, '13_whitespace' + suffix)}")
    facts["mask_cost"], fig = mask_cost(model, llm, args)
    console.print(f"saved {plots.save(fig, '13_mask_cost' + suffix)}")
    path = save_results(f"13_structured_outputs_{model.device.type}", dict(
        environment=environment(model), created=time.strftime("%Y-%m-%d %H:%M:%S"), max_tokens=args.max_tokens,
        samples=args.samples, steps=args.steps, repeats=args.repeats, seed=args.seed,
        disable_any_whitespace=llm.engine.config.disable_any_whitespace, load_average=list(os.getloadavg()),
        seconds=time.perf_counter() - start, **facts))
    console.print(f"saved {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
