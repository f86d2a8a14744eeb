"""xgrammar, the backend (chapter 13): a constraint becomes a grammar, compiled once for the
tokenizer, in a background thread, and kept by its text.

Two costs, paid in two places:

1. **Parsing** a schema, a regex or an EBNF grammar into xgrammar's `Grammar` takes well under a
   millisecond, so it happens in `add_request`, on the caller's thread: a constraint that means
   nothing is refused with a ValueError before the request exists.
2. **Compiling** that grammar for a tokenizer walks the whole vocabulary (which token may follow
   which grammar state) and costs from milliseconds (the embedded model's 4,096 tokens) to seconds
   (a 150k vocabulary and a large schema). It runs on a one-thread executor; the request waits
   beside the scheduler's queue until its future is done (scheduler.py), while the running batch
   keeps decoding. Equal constraints share one compile: the cache is keyed by the constraint's
   text (and, for JSON, the whitespace rule), so the thousandth request with a schema pays nothing.

xgrammar is imported only here and only when a request first asks for a constraint, so that an
engine without xgrammar installed serves everything else.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from minivllm.structured_outputs.params import StructuredOutputsParams

log = logging.getLogger("minivllm.engine")
MAX_CACHED = 128  # compiled grammars kept, least recently used dropped first (each holds per-vocabulary tables)
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # xgrammar's own threads within one compile

# JSON-schema keywords that xgrammar 0.2 compiles away without enforcing (measured: random walks
# through its masks wrote outputs that break them), so a schema using them is refused rather than
# quietly loosened. (minLength/maxLength alone are rewritten as a pattern: `bounded_strings`.)
UNENFORCED = {
    "allOf": "every one of several schemas", "oneOf": "exactly one (it is enforced as anyOf: at least one)",
    "not": "not", "if": "if/then/else", "then": "if/then/else", "else": "if/then/else",
    "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas", "dependencies": "dependencies",
    "propertyNames": "propertyNames", "maxProperties": "maxProperties",
    "unevaluatedProperties": "unevaluatedProperties",
    "uniqueItems": "uniqueItems", "contains": "contains", "minContains": "minContains", "maxContains": "maxContains",
    "unevaluatedItems": "unevaluatedItems", "minLength": "string lengths with a pattern or format",
    "maxLength": "string lengths with a pattern or format",
}
# A JSON string's character that needs no escape: xgrammar 0.2's own minLength/maxLength admit raw
# control characters, which JSON forbids (json.loads refuses them), so lengths become this pattern.
PLAIN_CHARACTER = r'[^"\\\x00-\x1f]'
MAX_STRING_LENGTH = 256
FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
           "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}  # the ones xgrammar writes
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
SCHEMA_LISTS = ("anyOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "additionalItems")


def import_xgrammar() -> Any:
    """The xgrammar module, or a ValueError that says how to get it (a request with a
    constraint cannot be served without it; every other request can)."""
    try:
        import xgrammar
    except ImportError as err:
        raise ValueError(f"structured outputs need the xgrammar package, which is not installed here ({err}); "
                         f"pip install xgrammar") from None
    return xgrammar


def unenforced_keyword(schema: Any, where: str = "schema") -> str | None:
    """Where `schema` uses a keyword xgrammar would not enforce, and why; None if nowhere.
    Walks only the subschemas (not property names, enum values or examples)."""
    if not isinstance(schema, dict):
        return None
    for key in schema:
        if key in UNENFORCED:
            return f"{where}.{key} ({UNENFORCED[key]})"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"{where}.multipleOf (only integers' multipleOf is enforced)"
    if "format" in schema and schema["format"] not in FORMATS:
        return f"{where}.format {schema['format']!r} (known formats: {', '.join(sorted(FORMATS))})"
    subschemas = []  # (where, subschema)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            subschemas += [(f"{where}.{key}.{name}", sub) for name, sub in schema[key].items()]
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            subschemas += [(f"{where}.{key}[{i}]", sub) for i, sub in enumerate(schema[key])]
    subschemas += [(f"{where}.{key}", schema[key]) for key in SCHEMA_VALUES if key in schema]
    return next(filter(None, (unenforced_keyword(sub, path) for path, sub in subschemas)), None)


def bounded_strings(schema: Any) -> Any:
    """The schema with every minLength/maxLength (without a pattern or format beside them)
    rewritten as a pattern of that many characters that JSON writes unescaped: the lengths hold
    exactly, in characters, and the output stays valid JSON. The price: such a string cannot
    hold a quote, a backslash or a control character (a subset of what the schema allows)."""
    if isinstance(schema, list):
        return [bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in ("enum", "const", "default", "examples") else bounded_strings(v) for k, v in schema.items()}
    low, high = out.get("minLength", 0), out.get("maxLength")
    lengths = ("minLength" in out or "maxLength" in out) and "pattern" not in out and "format" not in out
    if lengths and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (low, high or 0)):
        if high is not None and high < low:
            raise ValueError(f"a schema's maxLength {high} is below its minLength {low}: no string fits")
        if max(low, high or 0) > MAX_STRING_LENGTH:
            raise ValueError(f"a schema's string lengths are at most {MAX_STRING_LENGTH} here, got "
                             f"{max(low, high or 0)} (the pattern they become grows with them: 2,000 takes seconds "
                             f"to parse)")
        out.pop("minLength", None), out.pop("maxLength", None)
        out["pattern"] = f"^{PLAIN_CHARACTER}{{{low},{'' if high is None else high}}}$"
    return out


def xgrammar_message(err: Exception) -> str:
    """xgrammar's error without its C++ preamble ("[06:47:24] /project/cpp/x.cc:83: ")."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(err).strip()).splitlines()[0]


def parse(constraint: StructuredOutputsParams, any_whitespace: bool) -> Any:
    """The constraint as an xgrammar Grammar (not yet compiled), or a ValueError that says what
    is wrong with it. any_whitespace: JSON may hold free whitespace between its tokens."""
    xgr = import_xgrammar()
    kind, spec = constraint.kind, constraint.spec()
    if kind == "json":
        schema = bounded_strings(json.loads(spec))
        spec = json.dumps(schema)
        unenforced = unenforced_keyword(schema)
        if unenforced:
            raise ValueError(f"structured_outputs.json uses {unenforced}, which xgrammar does not enforce")
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            # One alternative per choice, each a string literal; JSON's string escapes are EBNF's.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in constraint.choice))
        return xgr.Grammar.from_ebnf(spec)
    except RuntimeError as err:
        raise ValueError(f"invalid structured_outputs.{kind}: {xgrammar_message(err)}") from None


class XgrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary, each once, in a background thread.

    vocab_size: the model's (its logits' width), which may exceed the tokenizer's: the ids past
    the tokenizer's are never allowed. stop_token_ids: the tokens that end a sequence (the
    model's EOS); the grammar allows them exactly where it may end."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        xgr = import_xgrammar()
        if len(tokenizer) > vocab_size:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocabulary of "
                             f"{vocab_size}: a grammar could allow a token the model cannot produce")
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                stop_token_ids=stop_token_ids or None)
        # Our own cache below keys by the constraint's text; xgrammar's would hold a second copy.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-grammar")
        self.cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()

    def compile(self, constraint: StructuredOutputsParams, disable_any_whitespace: bool) -> Future:
        """A future of the compiled grammar (xgrammar's CompiledGrammar). The constraint is
        checked now (ValueError); compiling happens in the background, once per distinct
        constraint. disable_any_whitespace: the engine's default, for a constraint that leaves
        it to the engine."""
        if constraint.disable_any_whitespace is not None:
            disable_any_whitespace = constraint.disable_any_whitespace
        any_whitespace = constraint.is_json and not disable_any_whitespace  # only JSON has free whitespace
        key = (constraint.kind, constraint.spec(), any_whitespace)
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        grammar = parse(constraint, any_whitespace)
        future = self.executor.submit(self.compile_grammar, grammar)
        self.cache[key] = future
        if len(self.cache) > MAX_CACHED:
            self.cache.popitem(last=False)  # its requests keep their own reference to the future
        return future

    def compile_grammar(self, grammar: Any) -> Any:
        """Runs on the executor's thread: the costly part, in xgrammar's C++ (the engine's thread
        keeps stepping meanwhile)."""
        return self.compiler.compile_grammar(grammar)
