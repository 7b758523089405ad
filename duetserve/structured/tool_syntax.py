"""The tool-call syntax the model writes, and its parser (one owner for both).

duetserve uses the Hermes / Qwen2.5 form for every model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls follow one another, separated by a newline. Qwen2.5's chat template
describes exactly this form when it is given `tools`; for a template that cannot render
tools, `tools_system_prompt` says the same in a system message. A forced tool choice
constrains the output to it (structured/grammars.py builds that grammar from these tags).

Pure Python, no torch, no llguidance: the server parses with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"            # between two calls, and inside the tags around the JSON
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        """The arguments as OpenAI sends them: a JSON string."""
        return json.dumps(self.arguments, ensure_ascii=False)


def format_tool_call(name: str, arguments: dict) -> str:
    """One call as the model writes it (used to render earlier turns for a template that
    cannot render tool calls itself)."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{CALL_SEPARATOR}{body}{CALL_SEPARATOR}{TOOL_CALL_CLOSE}"


def format_tool_response(content: str) -> str:
    """A tool's result as the model reads it (Qwen2.5's template writes the same)."""
    return f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"


def tools_system_prompt(tools: list[dict]) -> str:
    """A system message describing `tools` (OpenAI `{"type": "function", "function":
    {...}}` entries) and the call syntax, worded like Qwen2.5's template."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            f"within {TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{TOOL_CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{TOOL_CALL_CLOSE}")


def parse_call_body(body: str) -> ParsedToolCall | None:
    """The call inside one pair of tags, or None when it is not {"name": str,
    "arguments": object} (arguments given as a JSON string holding an object also pass)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a whole output. Blocks that parse become calls; everything
    else (text around them, a block that does not parse, an unclosed block) is content.
    With calls, the content is stripped and None when empty. Mutates nothing."""
    parser = ToolCallStreamParser()
    events = parser.feed(text) + parser.finish()
    calls = [e for e in events if isinstance(e, ParsedToolCall)]
    content = "".join(e for e in events if isinstance(e, str))
    if calls:
        content = content.strip() or None
    return content, calls


class ToolCallStreamParser:
    """Incremental form of `parse_tool_calls` for streamed text.

    `feed(delta)` returns the events that are certain so far: content strings (text that
    cannot be the start of a call) and ParsedToolCall objects (a block just closed).
    Text that could still be the opening tag, and the inside of an open block, are held
    back until they are decided; `finish()` releases what is left as content. Once a call
    was seen, whitespace-only content is dropped (the separators between calls).
    Mutates only its own buffer."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self.num_calls = 0

    def feed(self, delta: str) -> list[str | ParsedToolCall]:
        self._buf += delta
        events: list[str | ParsedToolCall] = []
        while True:
            if self._inside:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return events
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                call = parse_call_body(body)
                if call is None:
                    self._content(events, TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)
                else:
                    self.num_calls += 1
                    events.append(call)
                continue
            start = self._buf.find(TOOL_CALL_OPEN)
            if start >= 0:
                self._content(events, self._buf[:start])
                self._buf = self._buf[start + len(TOOL_CALL_OPEN):]
                self._inside = True
                continue
            keep = _partial_suffix(self._buf, TOOL_CALL_OPEN)
            self._content(events, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return events

    def finish(self) -> list[str | ParsedToolCall]:
        """Release the held-back text as content (an unclosed block keeps its tag)."""
        rest = (TOOL_CALL_OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
        events: list[str | ParsedToolCall] = []
        self._content(events, rest)
        return events

    def _content(self, events: list, text: str) -> None:
        if text and not (self.num_calls and not text.strip()):
            events.append(text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
