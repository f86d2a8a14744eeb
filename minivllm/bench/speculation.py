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
  size: the cost speculation adds to each target forward.
"""
from __future__ import annotations

import inspect
import random
import statistics
import time
from typing import Any

import torch

from minivllm.engine.llm import LLM
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.scheduler import SchedulerOutput
from minivllm.engine.sequence import Sequence, Status
from minivllm.machine import synchronize
from minivllm.model import Decoder

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
    """speculative_config for "ngram" (prompt lookup of up to 4 tokens) or "draft" (the draft model)."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    if method == "draft":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
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
                stats = llm.engine.speculator.stats
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


@torch.inference_mode()
def verify_cost(model: Decoder, engine_config: Any, batch_sizes: list[int], k: int, context: int,
                repeats: int = 5) -> list[dict[str, Any]]:
    """The median wall time of one decode step (1 token per sequence) and of one verify step
    (the newest token and k guesses per sequence) through the engine's model runner, by batch size.
    engine_config: a resolved EngineConfig with room for max(batch_sizes) sequences of context + 16 tokens."""
    runner = ModelRunner(model, engine_config)
    rows = []
    for batch in batch_sizes:
        seqs = _decoding(batch, context, engine_config.block_size, model.config.vocab_size, seed=batch)
        times = {}
        for name, guesses in (("decode", 0), ("verify", k)):
            for seq in seqs:
                seq.token_ids += [1] * guesses
                seq.num_spec_tokens = guesses
            schedule = SchedulerOutput(list(seqs), [1 + guesses] * batch)
            runner.run(schedule)  # warm-up: allocations, kernel compilation
            seconds = []
            for _ in range(repeats):
                synchronize(model.device)
                start = time.perf_counter()
                runner.run(schedule)
                synchronize(model.device)
                seconds.append(time.perf_counter() - start)
            times[name] = statistics.median(seconds)
            for seq in seqs:
                del seq.token_ids[len(seq.token_ids) - guesses:]
                seq.num_spec_tokens = 0
        rows.append(dict(batch_size=batch, decode_seconds=times["decode"], verify_seconds=times["verify"],
                         ratio=times["verify"] / times["decode"]))
    return rows
