"""What a request's output must match (structured output): a JSON schema, any JSON object, a regex, a grammar
(Lark-style EBNF, or GBNF) or one of a list of strings. Torch-free and library-free: this module only validates
and names the constraint; `runtime/grammar.py` compiles it (llguidance) and masks the target with it.

Each `SamplingParams` field that asks for structured output maps to one kind here; at most one may be set.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from spruce.errors import InvalidRequestError

MAX_SPEC_CHARS = 1 << 20  # a schema / regex / grammar text longer than this is refused (1 MiB)
MAX_CHOICES = 1024  # strings in a `choice` list
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")  # the SamplingParams field of each kind


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint: `kind` (a SamplingParams field name, in KINDS) and its text.

    json_schema: the schema as JSON text (key order kept: it orders the generated properties; the JSON is
    whitespace-free unless the schema says `"x-guidance": {"whitespace_flexible": true}`, llguidance's own option);
    json_object: '{"type": "object"}'; regex: the pattern (Rust regex syntax, matched against the whole output);
    grammar: a Lark-style EBNF grammar (llguidance's syntax) or a GBNF one (detected by `::=`); choice: a JSON list
    of the allowed strings. Hashable, so the grammar texts built from it can be cached by it."""

    kind: str
    text: str

    @property
    def field(self) -> str:
        """The request field to name in errors."""
        return self.kind


def structured_output_of(json_schema, json_object: bool, regex, grammar, choice) -> StructuredOutput | None:
    """Validate the structured-output fields of a request (at most one set) and return its constraint, or None.

    json_schema: a dict or its JSON text (a JSON object); json_object: bool; regex / grammar: non-empty
    strings; choice: a non-empty list of strings."""
    if not isinstance(json_object, bool):
        raise InvalidRequestError(f"json_object must be true or false, got {json_object!r}", field="json_object")
    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                      ("regex", regex), ("grammar", grammar), ("choice", choice))
             if value is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"at most one structured-output constraint may be given, got {', '.join(given)}",
                                  field=given[1])
    if not given:
        return None
    kind = given[0]
    if kind == "json_object":
        return StructuredOutput(kind, '{"type": "object"}')
    if kind == "json_schema":
        return StructuredOutput(kind, _schema_text(json_schema))
    if kind == "choice":
        return StructuredOutput(kind, _choice_text(choice))
    value = regex if kind == "regex" else grammar
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{kind} must be a non-empty string, got {_show(value)}", field=kind)
    _check_size(kind, value)
    return StructuredOutput(kind, value)


def _schema_text(schema) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"json_schema is not valid JSON ({e}): {_show(schema)}",
                                      field="json_schema") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"json_schema must be a JSON object (a schema), got {_show(schema)}",
                                  field="json_schema")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"json_schema must hold JSON values only: {e}", field="json_schema") from None
    _check_size("json_schema", text)
    return text


def _choice_text(choice) -> str:
    if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice:
        raise InvalidRequestError(f"choice must be a non-empty list of strings, got {_show(choice)}", field="choice")
    if len(choice) > MAX_CHOICES:
        raise InvalidRequestError(f"choice has {len(choice)} strings; at most {MAX_CHOICES} are allowed",
                                  field="choice")
    bad = [c for c in choice if not isinstance(c, str) or not c]
    if bad:
        raise InvalidRequestError(f"choice must hold non-empty strings, got {_show(bad[0])}", field="choice")
    text = json.dumps(list(choice))
    _check_size("choice", text)
    return text


def _check_size(kind: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"{kind} is {len(text)} characters long; at most {MAX_SPEC_CHARS} are allowed",
                                  field=kind)


def _show(value) -> str:
    """A value for an error message, cut to 80 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
