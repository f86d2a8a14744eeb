"""What a request may constrain its output to: vLLM's StructuredOutputsParams (chapter 13).

Exactly one constraint per request:

    json={...} or '{...}'     a JSON schema: the output is a JSON value that satisfies it
    json_object=True          any JSON object
    regex="[A-Z]{3}"          the whole output matches the regular expression
    choice=["yes", "no"]      the output is one of these strings, exactly
    grammar='root ::= ...'    the output is a sentence of this EBNF grammar (xgrammar's dialect)

Here only the shapes and types are checked, when the params are made; whether a schema, a
regular expression or a grammar means something is xgrammar's to say, and the engine asks it
when the request is added (backend.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
    return value


def _schema_text(value: Any) -> str:
    """A JSON schema, given as a dict or as its JSON text, as JSON text (keys in their order:
    the order of `properties` is the order the output writes them)."""
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
    elif isinstance(value, dict):
        schema = value
    else:
        raise ValueError(f"structured_outputs.json must be a JSON schema as a dict or a string, got "
                         f"{type(value).__name__} {value!r}")
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object ({{...}}), got {schema!r}")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"structured_outputs.json must hold only JSON values: {err}") from None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (see the module doc); exactly one of json, regex,
    choice, grammar and json_object is set. disable_any_whitespace: JSON (json, json_object)
    without free whitespace between its tokens, as `json.dumps` writes it; None leaves it to the
    engine's setting of the same name. A wrong type, no constraint or two are a ValueError."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            _schema_text(self.json)
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                _text(name, getattr(self, name))
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            for i, option in enumerate(self.choice):
                _text(f"choice[{i}]", option)
            object.__setattr__(self, "choice", list(self.choice))  # a copy: later edits by the caller change nothing
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True (or left out), got {self.json_object!r}")
        if self.disable_any_whitespace is not None and not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be True, False or None (the engine's "
                             f"default), got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @property
    def is_json(self) -> bool:
        return self.kind in ("json", "json_object")

    def spec(self) -> str:
        """The constraint as one text: the schema's JSON, the regex, the grammar, the choices
        as a JSON list, or "object". With the kind (and the whitespace rule), it names the
        compiled grammar in the engine's cache."""
        if self.json is not None:
            return _schema_text(self.json)
        if self.choice is not None:
            return json.dumps(self.choice, ensure_ascii=False)
        if self.json_object:
            return "object"
        return self.regex if self.regex is not None else self.grammar
