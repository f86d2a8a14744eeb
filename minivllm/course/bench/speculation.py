"""Chapter 12's measurements: what speculation buys, on code, and where it stops paying.

- `code_prompts`: the "speculation" workload's prompts, real Python code for the embedded model.
  Repetitive code (a class of getters and setters, each written like the one before) and
  ordinary code (the standard library's own source, which the embedded model was trained on,
  cut to the same length). Each ends mid-line, where the model continues well.
- `run_generation`: one engine setting on one batch of prompts: tokens/s, the tokens, the
  speculation counters.
- `acceptance_sweep`: acceptance and tokens per target forward against k, per proposer.
- `batch_sweep`: speed-up over plain decoding against batch size: the crossover.
- `verify_cost`: a verify step of k + 1 tokens per sequence against a decode step of 1, by batch
  size: the cost speculation adds to each target forward; replayed from graphs and run eagerly.
- `verify_padding`: how much of the verify graphs' work is padding on a real run.
- `pause_threshold`: the rule that chose disable_by_batch_size's defaults.
- `gpu_runbook`: what the GPU runbook measures for chapter 12 (verify / decode with graphs on the
  Qwen3-0.6B shape, and the embedded model's n-gram speed-up at batch 1), in one call.
"""
from __future__ import annotations

import dataclasses
import inspect
import random
import statistics
import time
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from minivllm.config.engine import EngineConfig
from minivllm.config.speculative import SpeculativeConfig
from minivllm.entrypoints.llm import LLM
from minivllm.machine import environment, synchronize
from minivllm.model import Decoder
from minivllm.request.sampling_params import SamplingParams
from minivllm.request.sequence import SchedulerOutput, Sequence, Status
from minivllm.worker.cuda_graphs import bucket_for, graph_batch_sizes
from minivllm.worker.model_runner import ModelRunner

FIELDS = ["name", "size", "color", "weight", "height", "width", "depth", "owner", "label", "price", "count", "kind",
          "title", "level", "score", "state", "value", "index"]
ORDINARY_MODULES = ["textwrap", "fractions", "shlex", "statistics", "string", "calendar", "difflib", "heapq"]


def repetitive_code(seed: int = 0) -> str:
    """A class whose methods repeat one pattern with another field name each (seeded order)."""
    fields = random.Random(seed).sample(FIELDS, len(FIELDS))
    code = "class Record:\n    def __init__(self):\n" + "".join(f"        self._{f} = None\n" for f in fields) + "\n"
    for f in fields:
        code += f"    def get_{f}(self):\n        return self._{f}\n\n    def set_{f}(self, value):\n        self._{f} = value\n\n"
    return code


def code_prompts(tokenizer: Any, kind: str, num_prompts: int, length: int) -> list[list[int]]:
    """num_prompts prompts of `length` tokens of real code, each cut mid-line (at a token that
    does not end a line, so the continuation starts inside a statement). kind: "repetitive" or
    "ordinary" (see the module doc)."""
    if kind not in ("repetitive", "ordinary"):
        raise ValueError(f"kind must be 'repetitive' or 'ordinary', got {kind!r}")
    prompts = []
    for i in range(num_prompts):
        if kind == "repetitive":
            ids = tokenizer.encode(repetitive_code(seed=i))
        else:
            module = __import__(ORDINARY_MODULES[i % len(ORDINARY_MODULES)])
            ids = tokenizer.encode(inspect.getsource(module))
        if len(ids) < length:
            raise ValueError(f"the {kind} code for prompt {i} has only {len(ids)} tokens, fewer than {length}")
        end = length
        while "\n" in tokenizer.decode(ids[end - 1:end]) and end > length // 2:
            end -= 1  # never end at a line break: the next line would start at column 0
        prompts.append(ids[:end])
    return prompts


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_generation(llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int = 1) -> dict[str, Any]:
    """Generate for all prompts at once, `repeats` times (after one untimed warm-up run); the
    best wall time, useful tokens/s, the tokens of the last run and its speculation counters."""
    llm.generate(prompts, params, use_tqdm=False)
    seconds, outputs = [], None
    for _ in range(repeats):
        synchronize(llm.engine.model.device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        synchronize(llm.engine.model.device)
        seconds.append(time.perf_counter() - start)
    tokens = [o.outputs[0].token_ids for o in outputs]
    drafted = sum(o.metrics.num_draft_tokens for o in outputs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    best = min(seconds)
    return dict(seconds=best, median_seconds=statistics.median(seconds), tokens_per_second=sum(map(len, tokens)) / best,
                tokens=tokens, draft_tokens=drafted, accepted_tokens=accepted,
                acceptance=accepted / drafted if drafted else None)


def method_config(method: str, k: int, draft: Any = None) -> dict[str, Any]:
    """speculative_config for "ngram" (prompt lookup of up to 4 tokens) or "draft" (the draft model),
    speculating at every batch size (no disable_by_batch_size): the sweeps measure speculation
    itself, which is what the pause's default is chosen from."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
                "disable_by_batch_size": None}
    if method == "draft":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "disable_by_batch_size": None}
    raise ValueError(f"method must be 'ngram' or 'draft', got {method!r}")


def acceptance_sweep(model: Decoder, tokenizer: Any, draft: Any, prompts: dict[str, list[list[int]]], ks: list[int],
                     max_tokens: int) -> list[dict[str, Any]]:
    """For each method, code kind and k: acceptance rate and tokens per target forward of the
    speculating sequences (greedy, all prompts of a kind in one batch)."""
    rows = []
    for method in ("ngram", "draft"):
        for kind, kind_prompts in prompts.items():
            for k in ks:
                llm = LLM(model, tokenizer=tokenizer, speculative_config=method_config(method, k, draft))
                llm.generate(kind_prompts, greedy(max_tokens), use_tqdm=False)
                stats = llm.engine.core.speculator.stats
                rows.append(dict(method=method, kind=kind, k=k, acceptance=stats.acceptance_rate,
                                 tokens_per_forward=stats.tokens_per_draft, drafts=stats.num_drafts,
                                 accepted_per_position=[a / d if d else None for a, d in
                                                        zip(stats.num_accepted_per_position, stats.num_drafts_per_position)]))
    return rows


def batch_sweep(model: Decoder, tokenizer: Any, draft: Any, prompts: list[list[int]], batch_sizes: list[int], k: int,
                max_tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Useful tokens/s of plain decoding and of each method at each batch size, measured side by
    side (the same prompts, the same engine settings), with the tokens checked identical. Batch b
    takes prompts[i % len(prompts)] for i < b: give prompts of one kind, so that only the batch
    size changes along the sweep."""
    rows = []
    for batch in batch_sizes:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        plain = run_generation(LLM(model, tokenizer=tokenizer, enable_prefix_caching=False), batch_prompts,
                               greedy(max_tokens), repeats)
        row = dict(batch_size=batch, plain_tokens_per_second=plain["tokens_per_second"])
        for method in ("ngram", "draft"):
            llm = LLM(model, tokenizer=tokenizer, enable_prefix_caching=False,
                      speculative_config=method_config(method, k, draft))
            spec = run_generation(llm, batch_prompts, greedy(max_tokens), repeats)
            row[method] = dict(tokens_per_second=spec["tokens_per_second"], acceptance=spec["acceptance"],
                               speedup=spec["tokens_per_second"] / plain["tokens_per_second"],
                               same_tokens=spec["tokens"] == plain["tokens"])
        rows.append(row)
    return rows


def _decoding(batch: int, context: int, block_size: int, vocab: int, seed: int) -> list[Sequence]:
    """`batch` sequences that have computed all but their newest token, blocks laid out in order."""
    rng = random.Random(seed)
    seqs, next_block = [], 0
    for i in range(batch):
        seq = Sequence(str(i), [rng.randrange(vocab) for _ in range(context)], SamplingParams(), context + 64)
        seq.num_computed_tokens, seq.status = context - 1, Status.RUNNING
        blocks = -(-(context + 16) // block_size)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    return seqs


def _median_step(runner: ModelRunner, schedule: SchedulerOutput, device: torch.device, repeats: int) -> float:
    runner.run(schedule)  # warm-up: allocations, kernel compilation
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        runner.run(schedule)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


@torch.inference_mode()
def verify_cost(model: Decoder, engine_config: EngineConfig, batch_sizes: list[int], k: int, context: int,
                repeats: int = 5, graphs: bool | None = None) -> list[dict[str, Any]]:
    """The median wall time of one decode step (1 token per sequence) and of one verify step
    (the newest token and k guesses per sequence) through the engine's model runner, by batch
    size: both as the engine runs them (replayed from the graphs of (bucket, 1) and (bucket, 1 + k)
    when graphs are on), and the verify step run eagerly (chapter 12 before its graphs).
    engine_config: a resolved EngineConfig with room for max(batch_sizes) sequences of context +
    16 tokens. graphs: None follows engine_config.cuda_graphs; True on a CPU replays EagerGraph
    (a dry run of the graphed path: the same buffers and padding, nothing to gain)."""
    graphs = engine_config.cuda_graphs if graphs is None else graphs
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": k})
    runner = ModelRunner(model, dataclasses.replace(engine_config, cuda_graphs=graphs, speculative_config=spec))
    eager = ModelRunner(model, dataclasses.replace(engine_config, cuda_graphs=False)) if graphs else runner
    rows = []
    for batch in batch_sizes:
        seqs = _decoding(batch, context, engine_config.block_size, model.config.vocab_size, seed=batch)
        decode = _median_step(runner, SchedulerOutput(list(seqs), [1] * batch), model.device, repeats)
        for seq in seqs:
            seq.token_ids += [1] * k
            seq.num_spec_tokens = k
        schedule = SchedulerOutput(list(seqs), [1 + k] * batch)
        verify = _median_step(runner, schedule, model.device, repeats)
        eager_verify = _median_step(eager, schedule, model.device, repeats) if eager is not runner else verify
        rows.append(dict(batch_size=batch, decode_seconds=decode, verify_seconds=verify,
                         eager_verify_seconds=eager_verify, ratio=verify / decode, eager_ratio=eager_verify / decode,
                         verify_replayed=runner.graphs is not None and runner.graphs.can_run(schedule.num_new_tokens)))
    return rows


def pause_threshold(batch_sizes: Seq[int], gains: Seq[float], below: float = 1.1) -> int | None:
    """The rule behind disable_by_batch_size's defaults (spec_decode/config.py): the smallest
    batch size (of an ascending sweep) at which speculation gains less than `below` times plain
    decoding, measured or predicted; None if it never does. Raises ValueError for sweeps of
    unequal lengths."""
    if len(batch_sizes) != len(gains):
        raise ValueError(f"{len(batch_sizes)} batch sizes but {len(gains)} gains")
    return next((b for b, gain in zip(batch_sizes, gains) if gain < below), None)


def verify_padding(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Run prompts through llm (speculation on) and count, over the steps a graph of (bucket,
    1 + k) would replay (every chunk at most 1 + k tokens, some longer than 1), the token rows
    that are padding: rows of sequences with fewer than k guesses, and rows of the sequences
    that pad the batch to its bucket. Also how many steps fall back to eager (longer chunks:
    prompts). Nothing here depends on whether graphs are on."""
    engine = llm.engine
    q = 1 + engine.config.speculative_config.num_speculative_tokens
    sizes = graph_batch_sizes(engine.config.max_num_seqs)
    counts = dict(decode_steps=0, verify_steps=0, eager_steps=0, real_rows=0, short_guess_rows=0, bucket_rows=0)
    run = engine.core.runner.run

    def counted(schedule: SchedulerOutput):
        lens = schedule.num_new_tokens
        if lens and max(lens) == 1:
            counts["decode_steps"] += 1
        elif lens and max(lens) <= q:
            counts["verify_steps"] += 1
            counts["real_rows"] += sum(lens)
            counts["short_guess_rows"] += q * len(lens) - sum(lens)
            counts["bucket_rows"] += q * (bucket_for(len(lens), sizes) - len(lens))
        elif lens:
            counts["eager_steps"] += 1
        return run(schedule)

    engine.core.runner.run = counted
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.core.runner.run
    rows = counts["real_rows"] + counts["short_guess_rows"] + counts["bucket_rows"]
    return counts | dict(k=q - 1, padding_share=(rows - counts["real_rows"]) / rows if rows else None,
                         short_guess_share=counts["short_guess_rows"] / rows if rows else None)


QWEN3_SHAPE = str(Path(__file__).parents[2] / "configs" / "qwen3-0.6b.json")  # the GPU workloads' model shape


def gpu_runbook(device: str = "cuda", shape: str | None = QWEN3_SHAPE, k: int = 4,
                batch_sizes: Seq[int] = (1, 4, 16, 64, 128, 256), context: int = 600, prompt_tokens: int = 300,
                output_tokens: int = 200, repeats: int = 3, graphs: bool | None = None) -> dict[str, Any]:
    """Chapter 12 on a GPU, in one call (the GPU runbook's part; on a CPU, a dry run):

    1. verify_cost on `shape` (a config.json: random weights, the device's default dtype; None:
       the embedded model): a verify step of k guesses against a decode step, both replayed
       from graphs, and the verify step run eagerly as before, at each batch size. graphs: None
       follows the device (on with CUDA); True on a CPU replays EagerGraph.
    2. The embedded model (real weights, so guesses are accepted; fp32, so the tokens can be
       compared exactly) at batch 1 on repetitive code: n-gram (k) against no speculation,
       tokens/s side by side, the tokens checked identical, the verify steps' padding counted.
    3. disable_by_batch_size's rule (pause_threshold) on the predicted gain per batch size: the
       tokens a verify step yielded in 2 over the verify / decode cost measured in 1.
    """
    from minivllm.loader import load_model, load_tokenizer

    model = load_model(shape, device=device)
    measured_on = dict(device=environment(model), shape=model.config.model_type,
                       parameters=model.config.num_parameters(), dtype=str(model.dtype).removeprefix("torch."))
    config = EngineConfig(max_num_seqs=max(batch_sizes),
                          num_kv_blocks=max(batch_sizes) * -(-(context + 16) // 16)).resolve(model)
    costs = verify_cost(model, config, list(batch_sizes), k, context, graphs=graphs)
    del model, config
    embedded, tokenizer = load_model(None, device=device, dtype=torch.float32), load_tokenizer(None)
    prompt = code_prompts(tokenizer, "repetitive", 1, prompt_tokens)
    plain = run_generation(LLM(embedded, tokenizer=tokenizer), prompt, greedy(output_tokens), repeats)
    spec = LLM(embedded, tokenizer=tokenizer, speculative_config=method_config("ngram", k))
    ngram = run_generation(spec, prompt, greedy(output_tokens), repeats)
    tokens_per_verify = spec.engine.core.speculator.stats.tokens_per_draft
    gains = [tokens_per_verify / row["ratio"] for row in costs]
    padding = verify_padding(LLM(embedded, tokenizer=tokenizer, speculative_config=method_config("ngram", k)),
                             prompt, greedy(output_tokens))
    drop = ("tokens",)
    return dict(k=k, context=context, verify_cost_model=measured_on, verify_cost=costs, end_to_end=dict(
        workload=f"batch 1, a {len(prompt[0])}-token prompt of repetitive code, {output_tokens} tokens, greedy",
        plain={key: v for key, v in plain.items() if key not in drop},
        ngram={key: v for key, v in ngram.items() if key not in drop},
        speedup=ngram["tokens_per_second"] / plain["tokens_per_second"], same_tokens=ngram["tokens"] == plain["tokens"],
        tokens_per_verify=tokens_per_verify), padding=padding,
        predicted_gain=[dict(batch_size=row["batch_size"], gain=g) for row, g in zip(costs, gains)],
        disable_by_batch_size=pause_threshold([row["batch_size"] for row in costs], gains))
