"""Chapter 13's measurements: how often outputs fit a format with and without the mask, how often
constrained JSON finishes with and without free whitespace, the mask step by step, and what the
mask costs per step against the batch size.

The structured workload (../shared/README.md): prompts that ask, in the embedded model's language
(Python source), for a JSON value, a label or a pattern, generated until the grammar ends.
Checking that an output fits a JSON schema needs `jsonschema` (a dev dependency).
"""
from __future__ import annotations

import json
import re
import statistics
import time
from typing import Any

import torch

from minivllm.core.trace import Trace
from minivllm.entrypoints.llm import LLM
from minivllm.machine import synchronize
from minivllm.request.sampling_params import SamplingParams
from minivllm.structured_outputs import StructuredOutputsParams
from minivllm.structured_outputs.backend import XgrammarBackend
from minivllm.structured_outputs.bitmask import apply_token_bitmask, num_words
from minivllm.structured_outputs.matcher import SequenceGrammar

JSON_PROMPTS = ["import json\n\nuser = json.loads('", "SERVER = ", "settings = dict(",
                "data = {'name': 'x'}\nother = "]
SCHEMAS: dict[str, dict[str, Any]] = {
    "user": {"type": "object", "properties": {"name": {"type": "string"},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                              "email": {"type": "string"}}, "required": ["name", "age"]},
    "server": {"type": "object", "properties": {"host": {"type": "string"},
                                                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                                "debug": {"type": "boolean"}}, "required": ["host", "port", "debug"]},
    "module": {"type": "object", "properties": {
        "title": {"type": "string"},
        "imports": {"type": "array", "items": {"enum": ["io", "os", "re", "sys"]}, "maxItems": 3},
        "author": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
        "required": ["title", "imports", "author"]},
    "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                               "y": {"type": "number"}}, "required": ["x", "y"]},
}
# What chapter 13 compares with and without the mask: one constraint of each kind.
FORMATS: dict[str, StructuredOutputsParams] = {
    "JSON schema (user)": StructuredOutputsParams(json=SCHEMAS["user"]),
    "any JSON object": StructuredOutputsParams(json_object=True),
    "regex [a-z_]{1,12} = [0-9]{1,3}": StructuredOutputsParams(regex=r"[a-z_]{1,12} = [0-9]{1,3}"),
    "choice: True / False / None": StructuredOutputsParams(choice=["True", "False", "None"]),
}
# An array that cannot end before 16 objects: every request of the masking benchmark decodes
# for as many steps as it is given, with masks as varied as JSON's (strings, numbers, keys).
LONG_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"},
                                                                          "id": {"type": "integer"}},
                                          "required": ["name", "id"]}, "minItems": 16}


def fits(constraint: StructuredOutputsParams, text: str, leading: bool = False) -> bool:
    """Whether text fits the constraint. leading: judge only the JSON value the text starts with
    (after whitespace), or the text up to its first line break for the other kinds: the generous
    reading of an output nothing told where to stop."""
    if constraint.is_json:
        try:
            import jsonschema
        except ImportError as err:
            raise ValueError("checking outputs against a JSON schema needs jsonschema: pip install jsonschema") from err
        try:
            value, end = json.JSONDecoder().raw_decode(text.lstrip()) if leading else (json.loads(text), 0)
        except json.JSONDecodeError:
            return False
        schema = constraint.json if constraint.json is not None else {"type": "object"}
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    if leading:
        text = text.split("\n", 1)[0]
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    return text in constraint.choice


def compile_seconds(llm: LLM, formats: dict[str, StructuredOutputsParams]) -> dict[str, float]:
    """How long each constraint takes to compile for the engine's tokenizer and vocabulary, on a
    backend of its own (so that no cache helps), waited for here."""
    engine = llm.engine
    grammars = XgrammarBackend(engine.tokenizer, engine.model.config.vocab_size, sorted(engine.core.eos_token_ids))
    seconds = {}
    for name, constraint in formats.items():
        start = time.perf_counter()
        grammars.compile(constraint, engine.config.disable_any_whitespace).result()
        seconds[name] = time.perf_counter() - start
    return seconds


def _requests(prompts: list[str], samples: int, max_tokens: int, constraint: StructuredOutputsParams | None,
              seed: int, greedy: bool = True) -> tuple[list[str], list[SamplingParams]]:
    """Every prompt greedy once (if `greedy`) and sampled `samples` times (temperature 1, seeded)."""
    texts, params = [], []
    for prompt in prompts:
        for k in range(0 if greedy else 1, samples + 1):
            texts.append(prompt)
            params.append(SamplingParams(temperature=0 if k == 0 else 1.0, seed=seed + k, max_tokens=max_tokens,
                                         structured_outputs=constraint))
    return texts, params


def validity(llm: LLM, prompts: list[str], formats: dict[str, StructuredOutputsParams], max_tokens: int,
             samples: int, seed: int = 0) -> dict[str, dict[str, dict[str, int]]]:
    """For each format, the same requests without and with the constraint: how many outputs fit
    it ("valid"), did not ("invalid"), or were cut by max_tokens before the grammar ended ("cut",
    constrained only). Unconstrained outputs are judged generously (fits(leading=True))."""
    result = {}
    for name, constraint in formats.items():
        counts = {}
        for mode, given in (("unconstrained", None), ("constrained", constraint)):
            texts, params = _requests(prompts, samples, max_tokens, given, seed)
            tally = {"valid": 0, "invalid": 0, "cut": 0}
            for out in llm.generate(texts, params, use_tqdm=False):
                c = out.outputs[0]
                if given is not None and c.finish_reason == "length":
                    tally["cut"] += 1
                else:
                    tally["valid" if fits(constraint, c.text, leading=given is None) else "invalid"] += 1
            counts[mode] = tally
        result[name] = counts
    return result


def finish_rates(llm: LLM, prompts: list[str], schemas: dict[str, dict], max_tokens: int, samples: int,
                 seed: int = 0) -> dict[str, dict[str, Any]]:
    """Constrained JSON with and without free whitespace, greedy and sampled: the share that
    finishes (the grammar ends) within max_tokens, how many of those fit, mean output tokens."""
    result = {}
    for disable in (True, False):
        for mode, n in (("greedy", 0), ("sampled", samples)):
            texts, params, constraints = [], [], []
            for schema in schemas.values():
                constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=disable)
                t, p = _requests(prompts, n, max_tokens, constraint, seed, greedy=not n)
                texts += t
                params += p
                constraints += [constraint] * len(t)
            outs = [o.outputs[0] for o in llm.generate(texts, params, use_tqdm=False)]
            finished = [(c, o) for c, o in zip(constraints, outs) if o.finish_reason == "stop"]
            result[f"{'no free' if disable else 'free'} whitespace, {mode}"] = dict(
                disable_any_whitespace=disable, mode=mode, requests=len(outs), finished=len(finished),
                fits=sum(fits(c, o.text) for c, o in finished),
                mean_tokens=statistics.mean(len(o.token_ids) for o in outs),
                example=outs[0].text)
    return result


def bitmask_steps(llm: LLM, prompt: str, constraint: StructuredOutputsParams, max_tokens: int) -> dict[str, Any]:
    """Generate greedily under the constraint, then replay the output through a fresh matcher:
    which tokens were allowed before each step ([steps, V] bool) and which one was taken."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint),
                       use_tqdm=False)[0].outputs[0]
    engine = llm.engine
    grammar = SequenceGrammar(engine.core.grammars.compile(constraint, engine.config.disable_any_whitespace))
    vocab = engine.model.config.vocab_size
    allowed = torch.zeros(len(out.token_ids), vocab, dtype=torch.bool)
    bitmask = torch.empty(1, num_words(vocab), dtype=torch.int32)
    for step, token in enumerate(out.token_ids):
        grammar.matcher.fill_next_token_bitmask(bitmask, 0)
        logits = torch.zeros(1, vocab)
        apply_token_bitmask(logits, bitmask, [0])
        allowed[step] = logits[0] == 0
        grammar.advance([token])
    tokenizer = llm.get_tokenizer()
    return dict(allowed=allowed, tokens=out.token_ids, text=out.text, finish_reason=out.finish_reason,
                labels=[tokenizer.decode([t]) if t not in engine.core.eos_token_ids else "EOS" for t in out.token_ids])


def _decode_steps(llm: LLM, prompts: list[str], constraint: StructuredOutputsParams | None, steps: int,
                  seed: int) -> tuple[list[float], list]:
    """Run the prompts together for `steps` + 1 tokens each; the seconds of every decode step
    that had them all, and the outputs."""
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=steps + 1, ignore_eos=True,
                             structured_outputs=constraint) for i in range(len(prompts))]
    llm.trace = Trace()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = [s.seconds for s in llm.trace.steps if not s.prefill and len(s.decode) == len(prompts)]
    return seconds, outs


def masking_cost(llm: LLM, batch_sizes: list[int], steps: int, repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per batch size B: the median decode step with B unconstrained requests and with B under
    LONG_SCHEMA (same prompts, sampled, side by side, repeats interleaved), and the mask's own
    parts replayed along the constrained outputs: filling B bitmask rows, applying them to
    [B, V] logits, advancing B matchers (median per step)."""
    constraint = StructuredOutputsParams(json=LONG_SCHEMA)
    engine = llm.engine
    device, vocab = engine.model.device, engine.model.config.vocab_size
    _decode_steps(llm, JSON_PROMPTS[:1], constraint, 4, seed)  # warm-up, and the grammar compiled
    rows = []
    for b in batch_sizes:
        prompts = [JSON_PROMPTS[i % len(JSON_PROMPTS)] for i in range(b)]
        plain, masked, outputs = [], [], None
        for r in range(repeats):
            for with_mask in ((False, True) if r % 2 == 0 else (True, False)):
                seconds, outs = _decode_steps(llm, prompts, constraint if with_mask else None, steps, seed + r)
                (masked if with_mask else plain).extend(seconds)
                if with_mask:
                    outputs = outs
        finished = sum(o.outputs[0].finish_reason == "stop" for o in outputs)
        future = engine.core.grammars.compile(constraint, engine.config.disable_any_whitespace)
        grammars = [SequenceGrammar(future) for _ in range(b)]
        bitmask = torch.empty(b, num_words(vocab), dtype=torch.int32)
        logits = torch.zeros(b, vocab, device=device)
        parts: dict[str, list[float]] = {"fill": [], "apply": [], "advance": []}
        for step in range(steps):
            t0 = time.perf_counter()
            for r, grammar in enumerate(grammars):
                grammar.matcher.fill_next_token_bitmask(bitmask, r)
            t1 = time.perf_counter()
            apply_token_bitmask(logits, bitmask, list(range(b)))
            synchronize(device)
            t2 = time.perf_counter()
            for grammar, out in zip(grammars, outputs):
                grammar.advance([out.outputs[0].token_ids[step]])
            t3 = time.perf_counter()
            for name, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[name].append(seconds)
        rows.append(dict(batch_size=b, steps=steps, plain_step_ms=1e3 * statistics.median(plain),
                         constrained_step_ms=1e3 * statistics.median(masked), constrained_finished_early=finished,
                         **{f"{name}_us": 1e6 * statistics.median(v) for name, v in parts.items()}))
    return rows
