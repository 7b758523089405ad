"""The tool-call parser, whole and streamed: every way of cutting the text into deltas
gives the same calls and content as parsing it whole."""
from __future__ import annotations

import itertools

import pytest

from duetserve.structured.tool_syntax import (ParsedToolCall, ToolCallStreamParser,
                                              format_tool_call, parse_tool_calls)

CALL = format_tool_call("get_weather", {"city": "Paris", "n": [1, 2]})
NOOP = format_tool_call("noop", {})

CASES = [
    ("Just text, no tools.", "Just text, no tools.", []),
    (CALL, None, ["get_weather"]),
    ("Let me check.\n" + CALL + "\n" + NOOP + "\n", "Let me check.", ["get_weather", "noop"]),
    ("a <tool_call>\nnot json\n</tool_call> b", "a <tool_call>\nnot json\n</tool_call> b", []),
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',     # arguments not object
     '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', []),
    ("x <tool_call>\n{\"name\": \"f\"", "x <tool_call>\n{\"name\": \"f\"", []),   # unclosed
    ("1 < 2 and <tool_ca", "1 < 2 and <tool_ca", []),           # a partial tag is text
    # bare calls (no tags) count only when the whole output is calls of declared tools
    (' {"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}\n', None,
     ["get_weather"]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2]}}, '
     '{"name": "noop", "arguments": {}}]', None, ["get_weather", "noop"]),
    ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),
    ('{"name": "noop", "arguments": {}} and more', '{"name": "noop", "arguments": {}} and more',
     []),
    ('{"a": 1}' + CALL, '{"a": 1}', ["get_weather"]),
]
NAMES = ("get_weather", "noop")


@pytest.mark.parametrize("text,content,names", CASES)
def test_parse_whole(text, content, names) -> None:
    got_content, calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [c.name for c in calls] == names
    if names:
        assert calls[0].arguments == ({"city": "Paris", "n": [1, 2]}
                                      if names[0] == "get_weather" else {})
        assert calls[0].arguments_json.startswith("{")


def _stream(pieces: list[str]) -> tuple[str, list[ParsedToolCall]]:
    parser = ToolCallStreamParser(NAMES)
    events = [e for p in pieces for e in parser.feed(p)] + parser.finish()
    return ("".join(e for e in events if isinstance(e, str)),
            [e for e in events if isinstance(e, ParsedToolCall)])


@pytest.mark.parametrize("text,content,names", CASES)
def test_stream_equals_whole_at_every_cut(text, content, names) -> None:
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    cuts = range(len(text) + 1)
    for i, j in itertools.combinations_with_replacement(cuts, 2):
        got_content, calls = _stream([text[:i], text[i:j], text[j:]])
        assert calls == whole_calls
        if whole_calls:     # whole: stripped, None when empty; streamed: as generated
            assert (got_content.strip() or None) == whole_content
        else:
            assert got_content == whole_content


def test_bare_calls_need_declared_names() -> None:
    bare = '{"name": "noop", "arguments": {}}'
    assert parse_tool_calls(bare) == (bare, [])                  # no tools offered
    assert parse_tool_calls(bare, ["noop"])[1] == [ParsedToolCall("noop", {})]


def test_stream_holds_back_only_a_possible_tag() -> None:
    parser = ToolCallStreamParser(NAMES)
    assert parser.feed("Sure <tool") == ["Sure "]       # "<tool" may open a call
    assert parser.feed("box>") == ["<toolbox>"]         # it did not
    assert parser.feed(CALL[:20]) == []                 # inside a call: wait for its end
    events = parser.feed(CALL[20:])
    assert [e.name for e in events] == ["get_weather"]
    assert parser.feed("\n") == [] and parser.finish() == []   # separators dropped
