"""Grammars and grammar states on a byte tokenizer (one token per byte): what each
constraint accepts and rejects, the errors, the cache, rollback. No model, no torch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import byte_tokenizer

from duetserve.errors import RequestError
from duetserve.sampling_params import GuidedDecoding, SamplingParams, SamplingParamsError
from duetserve.structured import GrammarCompiler, GrammarError
from duetserve.structured.grammars import closed_schema

VOCAB = 300
EOS = 299
TOK = byte_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TOK.to_str, VOCAB, (EOS,))


def ids(text: str) -> list[int]:
    return TOK.encode(text).ids


def accepts(compiler: GrammarCompiler, guided: GuidedDecoding, text: str) -> bool:
    """True when `text` followed by EOS is a complete output of the grammar."""
    state = compiler.new_state(guided)
    try:
        state.accept_all(ids(text) + [EOS])
    except GrammarError:
        return False
    return True


def schema(s: dict) -> GuidedDecoding:
    return GuidedDecoding("json", json.dumps(s), "response_format")


PERSON = schema({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age"]})


def test_json_schema_accepts_valid_and_rejects_invalid(compiler) -> None:
    assert accepts(compiler, PERSON, '{"name": "Bob", "age": 30}')
    assert accepts(compiler, PERSON, '{"name": "Bob", "age": 30, "tags": ["a", "b"]}')
    for bad in ('{"name": "Bob"}',                              # required field missing
                '{"name": "Bobby!", "age": 30}',                # maxLength
                '{"name": "Bob", "age": 121}',                  # maximum
                '{"name": "Bob", "age": 3, "tags": ["c"]}',     # enum
                '{"name": "Bob", "age": 3, "x": 1}',            # closed object
                '{"name":"Bob","age":30}',                      # separators are ", " ": "
                '{"name": "Bob", "age": 30}\n'):                # nothing after the value
        assert not accepts(compiler, PERSON, bad), bad


def test_other_kinds(compiler) -> None:
    choice = GuidedDecoding("choice", json.dumps(["a.b", "(x)", "1+1", "yes"]),
                            "guided_choice")
    for text in ("a.b", "(x)", "1+1", "yes"):
        assert accepts(compiler, choice, text)
    for text in ("aXb", "x", "11", "yes!", ""):
        assert not accepts(compiler, choice, text)
    regex = GuidedDecoding("regex", r"[0-9]{3}-[a-z]+", "guided_regex")
    assert accepts(compiler, regex, "123-abc")
    assert not accepts(compiler, regex, "12-abc")
    obj = GuidedDecoding("json_object", "", "response_format")
    assert accepts(compiler, obj, '{"a": [1, {"b": null}]}')
    assert not accepts(compiler, obj, "[1]")
    lark = GuidedDecoding("grammar", 'start: "x" ("," "x")*', "guided_grammar")
    assert accepts(compiler, lark, "x,x,x") and not accepts(compiler, lark, "x,")


def test_tool_calls_grammar(compiler) -> None:
    tools = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}},
        {"name": "noop", "parameters": {"type": "object"}}]
    one = GuidedDecoding("tool_calls", json.dumps({"tools": tools[:1], "parallel": False}),
                         "tools")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(compiler, one, call)
    assert not accepts(compiler, one, call.replace("get_weather", "get_time"))
    assert not accepts(compiler, one, call.replace('"city"', '"town"'))
    assert not accepts(compiler, one, call + "\n" + call)              # not parallel
    both = GuidedDecoding("tool_calls", json.dumps({"tools": tools, "parallel": True}),
                          "tools")
    noop = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert accepts(compiler, both, call + "\n" + noop)


@pytest.mark.parametrize("guided,words", [
    (schema({"type": "strin"}), ["strin"]),
    (schema({"type": "array", "uniqueItems": True}), ["Unimplemented", "uniqueItems"]),
    (schema({"type": "integer", "minimum": 5, "maximum": 2}), ["minimum"]),
    (GuidedDecoding("json", "{not json", "guided_json"), ["not valid JSON"]),
    (GuidedDecoding("regex", "[a-", "guided_regex"), ["regex"]),
    (GuidedDecoding("choice", "[]", "guided_choice"), ["non-empty"]),
    (GuidedDecoding("grammar", "start: undefined_rule", "guided_grammar"), ["grammar"]),
])
def test_invalid_constraints_name_their_field(compiler, guided, words) -> None:
    with pytest.raises(RequestError) as e:
        compiler.compile(guided)
    assert e.value.param == guided.param
    assert e.value.message.startswith(guided.param)
    assert all(w in e.value.message for w in words), e.value.message


def test_compiled_once_per_spec(compiler) -> None:
    guided = schema({"type": "object", "properties": {"k": {"enum": [1, 2]}}})
    before = compiler.num_compiled
    for param in ("response_format", "guided_json"):    # param is not part of the key
        compiler.compile(GuidedDecoding(guided.kind, guided.spec, param))
        compiler.new_state(guided)
    assert compiler.num_compiled == before + 1


def test_rollback_and_draft_validation(compiler) -> None:
    state = compiler.new_state(PERSON)
    prefix, rest = ids('{"name": "Al'), ids('", "age": 7}')
    state.accept_all(prefix)
    mask_at_prefix = state.matcher.compute_bitmask()
    assert state.num_valid_prefix(rest + ids("x")) == len(rest)      # mutates nothing
    state.accept_all(rest)
    assert state.is_finished and state.num_tokens == len(prefix) + len(rest)
    state.rollback(len(rest))
    assert state.num_tokens == len(prefix) and not state.is_finished
    assert state.matcher.compute_bitmask() == mask_at_prefix
    with pytest.raises(ValueError):
        state.rollback(len(prefix) + 1)
    with pytest.raises(GrammarError):
        state.accept(EOS)                          # the output is not complete


def test_closed_schema_rewrites_only_schemas() -> None:
    original = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "free": {"type": "object"},
        "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True}},
        "allOf": [{"properties": {"a": {}}}],
        "enum": [{"properties": {"z": 1}}]}
    out = closed_schema(original)
    assert out["additionalProperties"] is False
    inner = out["properties"]["properties"]
    assert inner["additionalProperties"] is False and "x" in inner["properties"]
    assert "additionalProperties" not in out["properties"]["free"]          # no properties
    assert out["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in out["allOf"][0]                     # allOf: open
    assert out["enum"] == original["enum"]                                   # data
    assert "additionalProperties" not in original                            # not mutated


def test_params_refuse_rules_that_fight_the_grammar() -> None:
    guided = GuidedDecoding("json_object", "", "response_format")
    for field, kw in (("ignore_eos", {"ignore_eos": True}), ("min_tokens", {"min_tokens": 2})):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(guided=guided, **kw)
        assert e.value.param == field
    with pytest.raises(SamplingParamsError):
        GuidedDecoding("yaml", "x")
    with pytest.raises(SamplingParamsError) as e:
        GuidedDecoding("regex", "", "guided_regex")
    assert e.value.param == "guided_regex"


def test_structured_never_imports_torch() -> None:
    code = ("import sys, duetserve.structured, duetserve.structured.grammars; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_random_walks_of_bounded_schemas_validate(compiler) -> None:
    """Any path the grammar allows (uniform random choices among allowed tokens) ends
    within the schema's output bound and is valid under the original schema."""
    import jsonschema
    import numpy as np
    from structured_schemas import bounded_schemas, output_bound

    rng = np.random.default_rng(0)
    for s in bounded_schemas(100, seed=1):
        state = compiler.new_state(schema(s))
        out: list[int] = []
        while True:
            words = np.frombuffer(state.matcher.compute_bitmask(), dtype=np.uint8)
            allowed = np.flatnonzero(np.unpackbits(words, bitorder="little")[:VOCAB])
            token = int(rng.choice(allowed))
            state.accept(token)
            if token == EOS:
                break
            out.append(token)
            assert len(out) <= output_bound(s), (s, TOK.decode(out))
        jsonschema.validate(json.loads(TOK.decode(out)), s)
