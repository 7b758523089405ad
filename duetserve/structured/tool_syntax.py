"""The tool-call syntax the model writes, and its parser (one owner for both).

duetserve uses the Hermes / Qwen2.5 form for every model:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls follow one another, separated by a newline. (Small models sometimes write
the call object without the tags: an output that is nothing but a call of a declared
tool, or a JSON list of them, counts as calls too.) Qwen2.5's chat template
describes exactly this form when it is given `tools`; for a template that cannot render
tools, `tools_system_prompt` says the same in a system message. A forced tool choice
constrains the output to it (structured/grammars.py builds that grammar from these tags).

Pure Python, no torch, no llguidance: the server parses with it.
"""
from __future__ import annotations

import json
from collections.abc import Collection
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


def _call_from(obj: object) -> ParsedToolCall | None:
    """{"name": str, "arguments": object} as a call (arguments given as a JSON string
    holding an object also pass), else None."""
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


def parse_call_body(body: str) -> ParsedToolCall | None:
    """The call inside one pair of tags, or None when it is not a call object."""
    try:
        return _call_from(json.loads(body))
    except ValueError:
        return None


def parse_bare_calls(text: str, names: Collection[str]) -> list[ParsedToolCall] | None:
    """Calls written without the tags (small models do this): the whole text is one call
    object, or a JSON list of them, and every call names one of `names`. Else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call_from(item) for item in items]
    if not calls or any(c is None or c.name not in names for c in calls):
        return None
    return calls   # type: ignore[return-value]


def parse_tool_calls(text: str, names: Collection[str] = ()
                     ) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, calls) of a whole output. Blocks that parse become calls; everything
    else (text around them, a block that does not parse, an unclosed block) is content.
    An output that is only a bare call of a tool in `names` is a call too. With calls,
    the content is stripped and None when empty. Mutates nothing."""
    parser = ToolCallStreamParser(names)
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
    With tool `names`, an output that starts (after whitespace) with "{" or "[" is held
    back whole: at the end it is either a bare call (parse_bare_calls) or content.
    Mutates only its own buffers."""

    def __init__(self, names: Collection[str] = ()) -> None:
        self._buf = ""
        self._inside = False
        self.num_calls = 0
        self._names = frozenset(names)
        self._bare: bool | None = None if self._names else False   # None: undecided
        self._held = ""

    def feed(self, delta: str) -> list[str | ParsedToolCall]:
        if self._bare is not False:
            self._held += delta
            head = self._held.lstrip()
            if not head or (head[0] in "{[" and TOOL_CALL_OPEN not in self._held):
                self._bare = None if not head else True
                return []
            self._bare, delta, self._held = False, self._held, ""
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
        """Release the held-back text: a bare call, or content (an unclosed block keeps
        its tag)."""
        events: list[str | ParsedToolCall] = []
        if self._held:
            held, self._held, self._bare = self._held, "", False
            calls = parse_bare_calls(held.strip(), self._names)
            if calls is not None:
                self.num_calls += len(calls)
                return list(calls)
            self._content(events, held)
            return events
        rest = (TOOL_CALL_OPEN if self._inside else "") + self._buf
        self._buf, self._inside = "", False
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
