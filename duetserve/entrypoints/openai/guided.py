"""Request fields that constrain the output -> one GuidedDecoding.

    response_format  {"type": "text"}                       nothing
                     {"type": "json_object"}                any JSON object
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    guided_json      a schema (object or JSON text)         (vLLM's extras)
    guided_regex     a regular expression
    guided_choice    a list of strings
    guided_grammar   a Lark grammar (llguidance's dialect)

At most one of them per request (a 400 names the second). Only the shape is checked
here; whether the schema or regex compiles is the GrammarCompiler's answer, also a 400
naming the field.
"""
from __future__ import annotations

import json
from typing import Any

from duetserve.errors import RequestError
from duetserve.sampling_params import GuidedDecoding


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise RequestError(f"{param}: the schema is not valid JSON ({e})", param) from None
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: the schema must be a JSON object", param)
    # NOTE: sorted keys, so one schema sent with its keys in another order hits the cache.
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


def from_response_format(response_format: dict[str, Any] | None) -> GuidedDecoding | None:
    """GuidedDecoding for OpenAI's `response_format`, or None for text/absent."""
    param = "response_format"
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object", "", param)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format: json_schema needs {\"name\": ..., "
                               "\"schema\": {...}}; the schema is missing", param)
        return GuidedDecoding("json", _schema_text(spec["schema"], param), param)
    raise RequestError(f"response_format type must be 'text', 'json_object' or "
                       f"'json_schema', got {kind!r}", param)


def from_fields(response_format: dict[str, Any] | None, guided_json: Any,
                guided_regex: str | None, guided_choice: list[str] | None,
                guided_grammar: str | None) -> GuidedDecoding | None:
    """The one constraint these fields ask for, or None. Raises RequestError naming the
    field at fault (a malformed value, or a second constraint)."""
    found: list[GuidedDecoding] = []
    rf = from_response_format(response_format)
    if rf is not None:
        found.append(rf)
    if guided_json is not None:
        found.append(GuidedDecoding("json", _schema_text(guided_json, "guided_json"),
                                    "guided_json"))
    if guided_regex is not None:
        found.append(GuidedDecoding("regex", guided_regex, "guided_regex"))
    if guided_choice is not None:
        if not guided_choice or not all(isinstance(c, str) and c for c in guided_choice):
            raise RequestError("guided_choice must be a non-empty list of non-empty "
                               "strings", "guided_choice")
        found.append(GuidedDecoding("choice", json.dumps(guided_choice, ensure_ascii=False),
                                    "guided_choice"))
    if guided_grammar is not None:
        found.append(GuidedDecoding("grammar", guided_grammar, "guided_grammar"))
    if len(found) > 1:
        raise RequestError(f"{found[1].param} cannot be combined with {found[0].param}: "
                           "one output constraint per request", found[1].param)
    return found[0] if found else None
