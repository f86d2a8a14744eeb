"""Chapter 13: structured outputs. Greedy tokens under a constraint equal transformers' logits
masked by a separate xgrammar matcher, argmax, token by token (with the logprobs of the masked
distribution); every finished output fits its constraint (json.loads + jsonschema, regex full
match, one of the choices, a grammar's sentences) on the embedded model and on tiny random
Qwen3 and Llama models with the embedded tokenizer, greedy and sampled; bad constraints are
refused when the request is added; a slow compile never stalls the running batch; n > 1,
preemption, prefix caching, stop strings and ignore_eos keep working; and the two exercises
against hand-built expectations.

The engine's xgrammar is imported lazily; these checks need it installed (a project
dependency), and skip where it is not, except the one that proves the engine works without it.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
import transformers

from minivllm import (DEFAULT_MODEL, DRAFT_MODEL, LLM, LLMEngine, SamplingParams, StructuredOutputsParams, load_model,
                      load_tokenizer)
from minivllm.structured_outputs import backend
from minivllm.structured_outputs.bitmask import apply_token_bitmask
from minivllm.structured_outputs.matcher import advance_matcher
from tiny_models import tiny_hf_model

pytestmark = [pytest.mark.ch13, pytest.mark.floors]
xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

EOS = 0  # the embedded tokenizer's <|endoftext|>
# Nested objects, an array of enums with bounds on its length, numbers with bounds, optional
# fields (size, owner.admin), a string held by a pattern (a random model's free strings never end).
RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 1, "maximum": 999},
    "kind": {"enum": ["file", "dir", "link"]},
    "size": {"type": "number", "minimum": 0, "maximum": 1.5},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                               "admin": {"type": "boolean"}}, "required": ["name"]},
    "tags": {"type": "array", "items": {"enum": ["io", "os", "re"]}, "minItems": 1, "maxItems": 3}},
    "required": ["id", "kind", "owner", "tags"]}
USER = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 150},
                                         "email": {"type": "string"}}, "required": ["name", "age"]}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["yes", "no", "maybe not"]
GRAMMAR = 'root ::= "def " name "(" name? "):"\nname ::= [a-z_]+'  # xgrammar's EBNF
PROMPTS = ["import json\n\nuser = json.loads('", "config = ", "def load():\n    return "]


def fits(constraint: StructuredOutputsParams, text: str) -> bool:
    """Whether text fits the constraint, judged without xgrammar."""
    if constraint.json is not None or constraint.json_object:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        schema = constraint.json if constraint.json is not None else {"type": "object"}
        return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).is_valid(value)
    if constraint.regex is not None:
        return re.fullmatch(constraint.regex, text) is not None
    if constraint.choice is not None:
        return text in constraint.choice
    return re.fullmatch(r"def [a-z_]+\(([a-z_]+)?\):", text) is not None  # GRAMMAR, as a regex


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def embedded_hf():
    return transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def embedded(embedded_hf):
    return load_model(embedded_hf, device="cpu")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny_hf(request):
    """A tiny random model with the embedded tokenizer's vocabulary of 4,096 (and no EOS of its
    own: only the grammar ends its outputs)."""
    return tiny_hf_model(request.param, vocab_size=4096)


def reference_grammar(tokenizer, vocab_size: int, kind: str, spec) -> object:
    """The constraint compiled by a compiler of the test's own, straight from xgrammar."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info)
    if kind == "json":
        return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
    return compiler.compile_regex(spec) if kind == "regex" else compiler.compile_grammar(spec)


def masked_greedy(hf_model, compiled, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' logits, masked by a fresh matcher's bitmask (xgrammar's own kernel), argmax,
    advance: the tokens and their log-probabilities under the mask (compiled=None: no mask, and
    EOS is just a token)."""
    matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
    bitmask = xgr.allocate_token_bitmask(1, hf_model.config.vocab_size)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = hf_model(torch.tensor([prompt + tokens])).logits[:, -1].float()
            if matcher is not None:
                matcher.fill_next_token_bitmask(bitmask, 0)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(logits.log_softmax(-1)[0, token]))
            if matcher is not None:
                assert matcher.accept_token(token)
                if matcher.is_terminated():
                    break
    return tokens, logprobs


CASES = [("json", RECORD, StructuredOutputsParams(json=RECORD)),
         ("regex", REGEX, StructuredOutputsParams(regex=REGEX)),
         ("grammar", 'root ::= "yes" | "no" | "maybe not"', StructuredOutputsParams(choice=CHOICES)),
         ("grammar", GRAMMAR, StructuredOutputsParams(grammar=GRAMMAR))]


@pytest.mark.parametrize("kind, spec, constraint", CASES, ids=["json", "regex", "choice", "grammar"])
def test_greedy_equals_transformers_under_the_same_mask(embedded_hf, embedded, tokenizer, kind, spec, constraint):
    """Token by token and logprob by logprob, beside an unconstrained request in the same batch
    (whose row the mask must not touch)."""
    compiled = reference_grammar(tokenizer, embedded_hf.config.vocab_size, kind, spec)
    llm = LLM(embedded, tokenizer=tokenizer)
    prompt = tokenizer.encode(PROMPTS[0])
    expected, logprobs = masked_greedy(embedded_hf, compiled, prompt, 96)
    params = SamplingParams(temperature=0, max_tokens=96, logprobs=0, structured_outputs=constraint)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got, free = llm.generate([prompt, prompt], [params, plain], use_tqdm=False)
    out = got.outputs[0]
    assert out.token_ids == expected, f"{tokenizer.decode(out.token_ids)!r} != {tokenizer.decode(expected)!r}"
    assert expected[-1] == EOS and out.finish_reason == "stop" and fits(constraint, out.text), out.text
    assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(logprobs, abs=1e-4)
    assert free.outputs[0].token_ids == masked_greedy(embedded_hf, None, prompt, 8)[0]


@pytest.mark.parametrize("kind, spec, constraint", CASES[:2], ids=["json", "regex"])
def test_greedy_equals_transformers_on_tiny_models(tiny_hf, tokenizer, kind, spec, constraint):
    compiled = reference_grammar(tokenizer, 4096, kind, spec)
    prompt = tokenizer.encode(PROMPTS[1])
    expected, _ = masked_greedy(tiny_hf, compiled, prompt, 96)
    params = SamplingParams(temperature=0, max_tokens=96, structured_outputs=constraint)
    out = LLM(tiny_hf, tokenizer=tokenizer, device="cpu").generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected
    assert out.finish_reason == "stop" and fits(constraint, out.text), out.text


CONSTRAINTS = [StructuredOutputsParams(json=RECORD), StructuredOutputsParams(json=USER),
               StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=REGEX),
               StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GRAMMAR)]


def generate_all(llm: LLM, constraints: list[StructuredOutputsParams], samples: int, max_tokens: int) -> list:
    """Every constraint on every prompt, greedy once and sampled `samples` times (seeded), in
    one batch; returns (constraint, CompletionOutput) pairs."""
    prompts, params, asked = [], [], []
    for constraint in constraints:
        for prompt in PROMPTS:
            for k in range(samples + 1):
                prompts.append(prompt)
                params.append(SamplingParams(temperature=0 if k == 0 else 1.0, seed=k, max_tokens=max_tokens,
                                             structured_outputs=constraint))
                asked.append(constraint)
    return [(c, out.outputs[0]) for c, out in zip(asked, llm.generate(prompts, params, use_tqdm=False))]


def test_every_finished_output_fits_on_the_embedded_model(embedded, tokenizer):
    results = generate_all(LLM(embedded, tokenizer=tokenizer), CONSTRAINTS, samples=2, max_tokens=96)
    finished = [(c, out) for c, out in results if out.finish_reason == "stop"]
    wrong = [(c.kind, out.text) for c, out in finished if not fits(c, out.text)]
    assert not wrong, wrong
    kinds = {c.kind for c, _ in finished}
    assert kinds == {"json", "json_object", "regex", "choice", "grammar"}, f"some constraint never finished: {kinds}"
    assert all(out.token_ids[-1] == EOS for _, out in finished), "a grammar ends where it allows EOS"


def test_every_finished_output_fits_on_tiny_models(tiny_hf, tokenizer):
    constraints = [StructuredOutputsParams(json=RECORD), StructuredOutputsParams(regex=REGEX),
                   StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GRAMMAR)]
    results = generate_all(LLM(tiny_hf, tokenizer=tokenizer, device="cpu"), constraints, samples=3, max_tokens=64)
    finished = [(c, out) for c, out in results if out.finish_reason == "stop"]
    wrong = [(c.kind, out.text) for c, out in finished if not fits(c, out.text)]
    assert not wrong, wrong
    assert {c.kind for c, _ in finished} == {"json", "regex", "choice", "grammar"}
    assert len(finished) >= len(results) // 2, f"only {len(finished)} of {len(results)} finished"


BOUNDED = {"type": "object", "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                                            "n": {"type": "integer", "minimum": 0, "maximum": 150},
                                            "s": {"type": "string"}}, "required": ["x", "n", "s"]}


@pytest.mark.parametrize("text, allowed", [
    ('{"x": 0.5, "n": 150, "s": "a"}', True), ('{"x": -1, "n": 0, "s": "a"}', True),
    ('{"x": 1.9, "n": 1, "s": "a"}', False), ('{"x": -1.5, "n": 1, "s": "a"}', False),
    ('{"x": 0, "n": 151, "s": "a"}', False), ('{"x": 0, "n": 1, "s": "a\x01"}', False)])
def test_the_grammar_holds_numbers_in_their_bounds_and_strings_free_of_control_characters(tokenizer, text, allowed):
    """What the xgrammar floor in pyproject.toml is for: before 0.2.3 a number with a fractional
    part could pass its maximum ("1.9" under a maximum of 1), which a sampled output then does.
    The engine's own compile, fed the text's tokens and then EOS, judged against json + jsonschema."""
    assert allowed == fits(StructuredOutputsParams(json=BOUNDED), text)
    grammars = backend.XgrammarBackend(tokenizer, len(tokenizer), [EOS])
    matcher = xgr.GrammarMatcher(grammars.compile(StructuredOutputsParams(json=BOUNDED), True).result(timeout=60))
    accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text) + [EOS])
    assert accepted == allowed and matcher.is_terminated() == allowed, text


def test_unconstrained_json_breaks_where_constrained_json_holds(embedded, tokenizer):
    """The chapter's claim, small: the same prompts without the constraint rarely give JSON."""
    llm = LLM(embedded, tokenizer=tokenizer)
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    constraint = StructuredOutputsParams(json=USER)
    held = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=96, structured_outputs=constraint),
                        use_tqdm=False)
    assert not any(fits(constraint, out.outputs[0].text) for out in free)
    assert all(fits(constraint, out.outputs[0].text) for out in held if out.outputs[0].finish_reason == "stop")


def test_json_without_free_whitespace_is_what_json_dumps_writes(embedded, tokenizer):
    """disable_any_whitespace (the engine's default): ", " and ": " between tokens, nothing else;
    with free whitespace allowed the same request is a different output."""
    llm = LLM(embedded, tokenizer=tokenizer)
    assert llm.engine.config.disable_any_whitespace is True
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=96,
                                                structured_outputs=StructuredOutputsParams(json=USER)), use_tqdm=False)
    finished = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert finished and all(text == json.dumps(json.loads(text), ensure_ascii=False) for text in finished), finished
    spaced = StructuredOutputsParams(json=USER, disable_any_whitespace=False)
    loose = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, structured_outputs=spaced),
                         use_tqdm=False)[0].outputs[0].text
    assert loose != outs[0].outputs[0].text[:len(loose)] and re.search(r"\s{2}", loose), loose


# ---- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(json=3), "dict or a string"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json="[1, 2]"), "schema object"),
    (dict(json={"default": float("nan")}), "only JSON values"),
    (dict(regex=""), "non-empty string"),
    (dict(regex=b"a"), "non-empty string"),
    (dict(choice="yes"), "list of strings"),
    (dict(choice=[]), "list of strings"),
    (dict(choice=["a", 1]), r"choice\[1\]"),
    (dict(grammar=None, json_object=False), "must be True"),
    (dict(json_object=1), "must be True"),
    (dict(json_object=True, disable_any_whitespace="yes"), "disable_any_whitespace"),
])
def test_malformed_constraints_are_refused_when_made(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_check_how_a_constraint_fits():
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(json={"type": "foo"}), "invalid structured_outputs.json"),
    (StructuredOutputsParams(json={"allOf": [{"type": "integer"}]}), r"schema\.allOf"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string", "maxLength": 3,
                                                                           "pattern": "[a-z]+"}}}),
     r"schema\.properties\.a\.maxLength"),
    (StructuredOutputsParams(json={"type": "string", "minLength": 3, "maxLength": 2}), "no string fits"),
    (StructuredOutputsParams(json={"type": "string", "maxLength": 1000}), "at most 256"),
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "number", "multipleOf": 0.5}}),
     r"schema\.items\.multipleOf"),
    (StructuredOutputsParams(json={"type": "string", "format": "weird"}), "format 'weird'"),
    (StructuredOutputsParams(json={"anyOf": [{"type": "integer"}, {"not": {"type": "null"}}]}), r"anyOf\[1\]\.not"),
    (StructuredOutputsParams(regex="a(b"), "invalid structured_outputs.regex"),
    (StructuredOutputsParams(regex="(?<=a)b"), "invalid structured_outputs.regex"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "invalid structured_outputs.grammar"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "invalid structured_outputs.grammar"),
])
def test_meaningless_constraints_are_refused_when_added(embedded, tokenizer, constraint, message):
    engine = LLMEngine(embedded, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt="x = ", params=SamplingParams(structured_outputs=constraint))
    assert not engine.requests and not engine.has_unfinished_requests()


def test_property_names_are_not_mistaken_for_keywords(embedded, tokenizer):
    """A property called "not" or "contains" is a name, not a keyword."""
    schema = {"type": "object", "properties": {"not": {"type": "boolean"}, "contains": {"enum": ["a"]}},
              "required": ["not", "contains"]}
    out = LLM(embedded, tokenizer=tokenizer).generate("x = ", SamplingParams(
        temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)[0]
    assert fits(StructuredOutputsParams(json=schema), out.outputs[0].text), out.outputs[0].text


def test_a_model_without_a_tokenizer_is_refused(embedded):
    engine = LLMEngine(embedded)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request(prompt=[5, 6, 7], params=SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    assert not engine.has_unfinished_requests()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(qwen3_model, tokenizer):
    """The tiny models' vocabulary is 97 tokens: a grammar over 4,096 could allow ids it has no logit for."""
    engine = LLMEngine(qwen3_model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="more than the model's vocabulary of 97"):
        engine.add_request(prompt=[5, 6], params=SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    assert not engine.has_unfinished_requests()


def test_without_xgrammar_a_constraint_is_refused_and_the_rest_is_served(embedded, tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    llm = LLM(embedded, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="pip install xgrammar"):
        llm.generate("x = ", SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)))
    assert len(llm.generate("x = ", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) >= 1


def test_the_engine_imports_xgrammar_only_for_a_constraint():
    code = ("import sys, minivllm, minivllm.config.engine\n"
            "minivllm.config.engine.PERSISTENT_BATCH_DEFAULT = False\n"  # the runner as chapter 13 knew it (LATER_DEFAULTS)
            "llm = minivllm.LLM(device='cpu')\n"
            "llm.generate('x = ', minivllm.SamplingParams(max_tokens=2), use_tqdm=False)\n"
            "assert 'xgrammar' not in sys.modules, 'imported for a request without a constraint'\n"
            "so = minivllm.StructuredOutputsParams(regex='[0-9]+')\n"
            "llm.generate('x = ', minivllm.SamplingParams(max_tokens=2, structured_outputs=so), use_tqdm=False)\n"
            "assert 'xgrammar' in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- compiling in the background ------------------------------------------------------------


def test_a_slow_compile_never_stalls_the_running_batch(embedded, tokenizer, monkeypatch):
    """The grammar's compile is held until the unconstrained request has finished: that request
    runs its 8 steps as if alone, and a step with only the compiling one left returns at once."""
    release, threads = threading.Event(), []
    compile_grammar = backend.XgrammarBackend.compile_grammar

    def held(self, grammar):
        threads.append(threading.current_thread().name)
        release.wait(timeout=60)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(backend.XgrammarBackend, "compile_grammar", held)
    engine = LLMEngine(embedded, tokenizer=tokenizer)
    constraint = StructuredOutputsParams(choice=CHOICES)
    engine.add_request(prompt="x = ", params=SamplingParams(temperature=0, max_tokens=16, structured_outputs=constraint), request_id="choice")
    engine.add_request(prompt=PROMPTS[2], params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), request_id="plain")
    try:
        for step in range(8):
            outputs = engine.step()
            assert [o.request_id for o in outputs] == ["plain"], f"step {step}: {outputs}"
        assert outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 8
        assert [s.request_id for s in engine.core.scheduler.waiting_for_grammar] == ["choice"]
        start = time.perf_counter()
        assert engine.step() == []  # nothing to run: it waits a little for the grammar, then returns
        assert time.perf_counter() - start < 5
    finally:
        release.set()
    for _ in range(200):
        for out in engine.step():
            finished = out
        if not engine.has_unfinished_requests():
            break
    assert finished.request_id == "choice" and finished.outputs[0].text in CHOICES
    assert threads and all(name.startswith("minivllm-grammar") for name in threads), threads


def test_each_constraint_is_compiled_once(embedded, tokenizer, monkeypatch):
    calls = []
    compile_grammar = backend.XgrammarBackend.compile_grammar
    monkeypatch.setattr(backend.XgrammarBackend, "compile_grammar",
                        lambda self, grammar: calls.append(str(grammar)) or compile_grammar(self, grammar))
    llm = LLM(embedded, tokenizer=tokenizer)
    same = [StructuredOutputsParams(json=USER), StructuredOutputsParams(json=json.dumps(USER)),
            StructuredOutputsParams(json=USER, disable_any_whitespace=True)]  # the engine's default, said aloud
    llm.generate(["x = "] * 3, [SamplingParams(max_tokens=2, structured_outputs=c) for c in same], use_tqdm=False)
    assert len(calls) == 1
    other = [StructuredOutputsParams(json=USER, disable_any_whitespace=False), StructuredOutputsParams(regex="[0-9]+")]
    llm.generate(["x = "] * 2, [SamplingParams(max_tokens=2, structured_outputs=c) for c in other], use_tqdm=False)
    assert len(calls) == 3


# ---- with the rest of the engine --------------------------------------------------------------


def test_n_completions_each_follow_their_own_matcher(embedded, tokenizer):
    constraint = StructuredOutputsParams(json=RECORD)
    out = LLM(embedded, tokenizer=tokenizer).generate(PROMPTS[1], SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=96, structured_outputs=constraint), use_tqdm=False)[0]
    finished = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert finished and all(fits(constraint, text) for text in finished)
    assert len({c.text for c in out.outputs}) > 1


def test_preemption_and_prefix_caching_leave_constrained_tokens_unchanged(embedded, tokenizer):
    """A pool so small that requests are preempted and recomputed (a matcher must not see its
    tokens twice), with and without prefix caching, against a roomy pool."""
    constraint = StructuredOutputsParams(json=USER)
    prompts = [PROMPTS[i % 3] + "  " * i for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=constraint)
    roomy = LLM(embedded, tokenizer=tokenizer, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    for caching in (False, True):
        tight = LLM(embedded, tokenizer=tokenizer, block_size=4, num_kv_blocks=40, enable_prefix_caching=caching)
        outs = tight.generate(prompts, params, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to force preemptions"
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


def test_a_stop_string_still_ends_a_constrained_request(embedded, tokenizer):
    out = LLM(embedded, tokenizer=tokenizer).generate("x = ", SamplingParams(
        temperature=0, max_tokens=16, stop=[" "], structured_outputs=StructuredOutputsParams(choice=["maybe not"])),
        use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("maybe", "stop", " ")


def test_a_grammar_that_has_ended_ends_its_request_even_with_ignore_eos(embedded, tokenizer):
    out = LLM(embedded, tokenizer=tokenizer).generate("x = ", SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
        use_tqdm=False)[0].outputs[0]
    assert out.text in CHOICES and out.finish_reason == "stop" and out.token_ids[-1] == EOS


def test_engine_setting_disable_any_whitespace_is_checked():
    from minivllm import EngineConfig

    with pytest.raises(ValueError, match="disable_any_whitespace must be True, False or None"):
        EngineConfig(disable_any_whitespace=1)


# ---- the exercises ------------------------------------------------------------------------------


def reference_mask(bitmask: list[list[int]], vocab: int) -> list[list[bool]]:
    """Bit t % 32 of word t // 32, by plain integer arithmetic on the words as unsigned 32 bits."""
    return [[bool(((row[t // 32] & 0xFFFFFFFF) >> (t % 32)) & 1) for t in range(vocab)] for row in bitmask]


@pytest.mark.parametrize("vocab", [32, 70, 96])
def test_apply_token_bitmask_forbids_exactly_the_cleared_bits(vocab):
    words = -(-vocab // 32)
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int64, generator=gen).to(torch.int32)
    bitmask[1] = -1  # every bit set: bit 31 is the sign bit
    bitmask[2, 0] = -2**31  # only bit 31 of the first word: token 31 alone
    logits = torch.randn(5, vocab, generator=gen)
    rows = [4, 0, 2]
    got = logits.clone()
    assert apply_token_bitmask(got, bitmask, rows) is None
    allowed = reference_mask(bitmask.tolist(), vocab)
    for r, row in enumerate(rows):
        for t in range(vocab):
            expected = logits[row, t].item() if allowed[r][t] else float("-inf")
            assert got[row, t].item() == expected, (f"row {row} (bitmask row {r}), token {t}: bit {t % 32} of word "
                                                    f"{t // 32} is {int(allowed[r][t])}, logit should be {expected}, "
                                                    f"got {got[row, t].item()}")
    for row in (1, 3):
        assert torch.equal(got[row], logits[row]), f"row {row} has no bitmask row and must stay untouched"
    assert allowed[1] == [True] * vocab and [t for t in range(vocab) if allowed[2][t]][:1] == [31]


def test_apply_token_bitmask_refuses_a_wrong_bitmask():
    logits = torch.zeros(2, 70)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.zeros(1, 3, dtype=torch.int64), [0])
    with pytest.raises(ValueError, match="shape"):
        apply_token_bitmask(logits, torch.zeros(1, 2, dtype=torch.int32), [0])
    with pytest.raises(ValueError, match="shape"):
        apply_token_bitmask(logits, torch.zeros(2, 3, dtype=torch.int32), [0])


@pytest.fixture(scope="module")
def choice_grammar(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096)
    return xgr.GrammarCompiler(info).compile_grammar('root ::= "maybe not" | "yes"')


def mask_of(matcher) -> list[int]:
    bitmask = xgr.allocate_token_bitmask(1, 4096)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0].tolist()


def test_advance_matcher_accepts_a_step_of_tokens(choice_grammar, tokenizer):
    tokens = tokenizer.encode("maybe not")
    matcher = xgr.GrammarMatcher(choice_grammar)
    start = mask_of(matcher)
    assert advance_matcher(matcher, []) is False and mask_of(matcher) == start, "[] changes nothing"
    assert advance_matcher(matcher, tokens[:1]) is False
    assert advance_matcher(matcher, tokens[1:]) is False, "the grammar may end here, but has not ended"
    assert matcher.is_completed() and advance_matcher(matcher, [EOS]) is True and matcher.is_terminated()
    several = xgr.GrammarMatcher(choice_grammar)
    assert advance_matcher(several, tokens + [EOS]) is True, "several tokens at once (speculative decoding)"


def test_advance_matcher_rolls_back_when_the_grammar_refuses(choice_grammar, tokenizer):
    tokens = tokenizer.encode("maybe not")
    matcher = xgr.GrammarMatcher(choice_grammar)
    advance_matcher(matcher, tokens[:1])
    before = mask_of(matcher)
    refused = tokenizer.encode("yes")[0]
    with pytest.raises(ValueError, match=f"token {refused} at index 1"):
        advance_matcher(matcher, tokens[1:2] + [refused])
    assert mask_of(matcher) == before, "the matcher must be as before the call, not half-advanced"
    advance_matcher(matcher, tokens[1:] + [EOS])
    with pytest.raises(ValueError, match="index 0"):  # a terminated matcher accepts nothing
        advance_matcher(matcher, [tokens[0]])
    assert matcher.is_terminated()


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("kind, spec, constraint", CASES[:2] + CASES[3:], ids=["json", "regex", "grammar"])
def test_speculation_under_a_grammar_equals_transformers(embedded_hf, embedded, tokenizer, kind, spec, constraint,
                                                         method):
    """Chapter 12 with chapter 13: each verify row is masked as the grammar stands after the
    guesses before it (speculator.mask_guesses), the matcher takes only the tokens appended.
    Greedy tokens equal transformers' masked argmax, and sampled outputs still fit."""
    speculative = ({"method": "ngram", "num_speculative_tokens": 4} if method == "ngram"
                   else {"model": DRAFT_MODEL, "num_speculative_tokens": 4})
    llm = LLM(embedded, tokenizer=tokenizer, speculative_config=speculative)
    compiled = reference_grammar(tokenizer, embedded_hf.config.vocab_size, kind, spec)
    prompt = tokenizer.encode(PROMPTS[0])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=96, structured_outputs=constraint),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == masked_greedy(embedded_hf, compiled, prompt, 96)[0]
    sampled = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=96, structured_outputs=constraint)
    for completion in llm.generate(prompt, sampled, use_tqdm=False)[0].outputs:
        assert completion.finish_reason == "length" or fits(constraint, completion.text), completion.text
    assert llm.engine.core.speculator.stats.num_draft_tokens > 0, "nothing was guessed: speculation was not tested"
