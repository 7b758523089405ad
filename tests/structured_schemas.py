"""Random JSON schemas whose every valid output is short: nested objects, arrays, enums,
required fields, integers and numbers with bounds, strings with a maximum length.

`output_bound(schema)` is an upper bound on the bytes of any output the grammar allows
(compact separators, closed objects, at most 6 bytes per string character: an \\uXXXX
escape). A token is at least one byte, so max_tokens = bound + 1 (the EOS) guarantees
that a constrained request ends by itself: every request must finish with "stop".
A plain module (not conftest.py) so tests import it by name.
"""
from __future__ import annotations

import json
import random

WORDS = ["red", "green", "blue", "cat", "dog", "yes", "no", "north", "south", "x1", "b-2"]
KEYS = ["name", "age", "tags", "score", "ok", "kind", "items", "meta", "id", "level", "note"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "enum_int"])
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 10)}
        if rng.random() < 0.3:
            s["minLength"] = 1
        return s
    if kind == "integer":
        return {"type": "integer", "minimum": rng.randint(-50, 0),
                "maximum": rng.randint(1, 1000)}
    if kind == "number":     # multiples of 1/4 or 1/2: exact in binary, so jsonschema agrees
        return {"type": "number", "minimum": rng.choice([-10, 0, 0.5]),
                "maximum": rng.choice([1, 20, 99.5]), "multipleOf": rng.choice([0.25, 0.5])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    return {"enum": rng.sample(range(-5, 50), 3)}


def make_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema with 1-4 properties; depth < 2 nests objects and arrays."""
    props: dict[str, dict] = {}
    for key in rng.sample(KEYS, rng.randint(1, 4)):
        r = rng.random()
        if depth < 2 and r < 0.2:
            props[key] = make_schema(rng, depth + 1)
        elif r < 0.45:
            item = make_schema(rng, depth + 1) if depth < 1 and r < 0.25 else _leaf(rng)
            props[key] = {"type": "array", "items": item, "minItems": rng.randint(0, 1),
                          "maxItems": rng.randint(1, 3)}
        else:
            props[key] = _leaf(rng)
    required = [k for k in props if rng.random() < 0.7]
    schema = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


def output_bound(schema: dict) -> int:
    """Upper bound on the bytes of any output valid under the (closed) schema."""
    if "enum" in schema:
        return max(len(json.dumps(v)) for v in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + 6 * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "number":
        return 1 + len(str(int(abs(schema["maximum"])) + 1)) + 3 + 2
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (output_bound(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k)) + 4 + output_bound(v)
                   for k, v in schema["properties"].items())


def bounded_schemas(n: int, seed: int = 0, max_bound: int = 220) -> list[dict]:
    """n schemas (deterministic for a seed) whose output bound is at most max_bound."""
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        s = make_schema(rng)
        if output_bound(s) <= max_bound:
            out.append(s)
    return out
