"""GuidedDecoding -> llguidance grammar text, checked against the tokenizer.

    json         the schema, objects closed (see `closed_schema`), compact separators
    json_object  {"type": "object"} with the same options
    regex        the expression (Rust `regex` syntax; the whole output must match)
    choice       an alternation of the escaped strings
    grammar      a Lark grammar (llguidance's dialect, may embed %json)
    tool_calls   Lark: one call block, or several when parallel, of any of the tools, in
                 the syntax of tool_syntax.py

JSON is generated with ", " and ": " separators and no other whitespace: a free choice
of whitespace lets a small model emit newlines forever, while these separators are what
models write anyway. Errors are RequestError naming GuidedDecoding.param; unsupported
schema keywords are named by llguidance ("Unimplemented keys: [...]").
"""
from __future__ import annotations

import json
from typing import Any

import llguidance as llg

from duetserve.errors import RequestError
from duetserve.sampling_params import GuidedDecoding
from duetserve.structured.tool_syntax import CALL_SEPARATOR, TOOL_CALL_CLOSE, TOOL_CALL_OPEN

JSON_OPTIONS: dict[str, Any] = {"item_separator": ", ", "key_separator": ": ",
                                "whitespace_flexible": False}
# Keys whose value is data, not a schema: never rewritten.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "required", "x-guidance"})
# Keys whose value maps names to schemas.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                          "dependentSchemas"})
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
# Rust regex metacharacters (regex-syntax's is_meta_character): escaped in choices.
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def closed_schema(schema: Any, close: bool = True) -> Any:
    """A copy of `schema` where every object schema that lists `properties` and says
    nothing about other properties gets `additionalProperties: false` (what OpenAI's
    strict mode requires and xgrammar's strict mode assumes). Output valid under the
    result is valid under the original. Subschemas of `allOf` are left open (each may
    list only some of the properties). Mutates nothing."""
    if isinstance(schema, list):
        return [closed_schema(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_schema(s) for name, s in value.items()}
        elif key == "allOf" and isinstance(value, list):
            out[key] = [closed_schema(s, close=False) for s in value]
        else:
            out[key] = closed_schema(value)
    if close and isinstance(schema.get("properties"), dict) \
            and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _load_json(text: str, what: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise RequestError(f"{param}: the {what} is not valid JSON ({e})", param) from None


def json_schema_grammar(schema: Any, param: str) -> str:
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: a JSON schema must be an object, got "
                           f"{type(schema).__name__}", param)
    try:
        return llg.LLMatcher.grammar_from_json_schema(closed_schema(schema),
                                                      defaults=JSON_OPTIONS)
    except ValueError as e:
        raise RequestError(f"{param}: invalid JSON schema: {e}", param) from None


def regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def choice_grammar(choices: Any, param: str) -> str:
    if not isinstance(choices, list) or not choices \
            or not all(isinstance(c, str) and c for c in choices):
        raise RequestError(f"{param}: the choices must be a non-empty list of non-empty "
                           "strings", param)
    return llg.LLMatcher.grammar_from_regex(
        "(?:" + "|".join(regex_escape(c) for c in choices) + ")")


def _tag(tokenizer: llg.LLTokenizer, text: str) -> str:
    """A Lark terminal for `text`: the token itself when the vocabulary has it as one
    special token (Qwen's <tool_call>; llguidance cannot spell special tokens from
    bytes), else the string."""
    ids = tokenizer.tokenize_str(text)
    if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_calls_grammar(spec: dict, tokenizer: llg.LLTokenizer, param: str) -> str:
    """Lark for one call (or several when spec["parallel"]) of any tool in spec["tools"]
    ([{"name", "parameters"}]), arguments valid under the tool's parameter schema."""
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise RequestError(f"{param}: no tools to call", param)
    variants = []
    for tool in tools:
        params = tool.get("parameters") or {"type": "object"}
        if not isinstance(params, dict):
            raise RequestError(f"{param}: the parameters of {tool.get('name')!r} must be a "
                               "JSON schema object", param)
        variants.append({"type": "object", "properties": {
            "name": {"const": tool["name"]}, "arguments": closed_schema(params)},
            "required": ["name", "arguments"], "additionalProperties": False})
    call = variants[0] if len(variants) == 1 else {"anyOf": variants}
    call = {**call, "x-guidance": JSON_OPTIONS}
    sep = json.dumps(CALL_SEPARATOR)
    block = (f"{_tag(tokenizer, TOOL_CALL_OPEN)} {sep} call_json {sep} "
             f"{_tag(tokenizer, TOOL_CALL_CLOSE)}")
    start = f"block ({sep} block)*" if spec.get("parallel") else "block"
    return llg.LLMatcher.grammar_from_lark(
        f"start: {start}\nblock: {block}\ncall_json: %json {json.dumps(call)}\n")


def build_grammar(guided: GuidedDecoding, tokenizer: llg.LLTokenizer) -> str:
    """The llguidance grammar for `guided`, validated against `tokenizer`. Raises
    RequestError(param=guided.param) naming what is wrong. Pure."""
    param, kind = guided.param, guided.kind
    if kind == "json":
        grammar = json_schema_grammar(_load_json(guided.spec, "schema", param), param)
    elif kind == "json_object":
        grammar = json_schema_grammar({"type": "object"}, param)
    elif kind == "regex":
        grammar = llg.LLMatcher.grammar_from_regex(guided.spec)
    elif kind == "choice":
        grammar = choice_grammar(_load_json(guided.spec, "choice list", param), param)
    elif kind == "grammar":
        grammar = llg.LLMatcher.grammar_from_lark(guided.spec)
    elif kind == "tool_calls":
        grammar = tool_calls_grammar(_load_json(guided.spec, "tool list", param),
                                     tokenizer, param)
    else:   # GuidedDecoding validated the kind
        raise RequestError(f"{param}: unknown constraint kind {kind!r}", param)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex",
                "choice": "choice list", "grammar": "grammar",
                "tool_calls": "tool parameters"}[kind]
        raise RequestError(f"{param}: invalid {what}: {messages[0][:600]}", param)
    return grammar
