"""OpenAI answers in one comparable shape: `collect` asks a server (non-streamed, or the
SSE chunks folded into one answer), `normalize` keeps what must match between set-ups
(index, text, finish reason, tokens, logprobs to 4 places)."""
from __future__ import annotations

import json

import httpx


def collect(base: str, body: dict, path: str = "/v1/completions") -> dict:
    """Non-streamed answer, or the streamed chunks folded into the same shape."""
    if not body.get("stream"):
        r = httpx.post(base + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    choices: dict[int, dict] = {}
    usage = None
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                acc = choices.setdefault(c["index"], {"text": "", "lps": [], "tokens": [],
                                                      "finish_reason": None})
                if "delta" in c:
                    acc["text"] += c["delta"].get("content") or ""
                    lps = (c.get("logprobs") or {}).get("content") or []
                    acc["lps"] += [round(e["logprob"], 4) for e in lps]
                    acc["tokens"] += [e["token"] for e in lps]
                else:
                    acc["text"] += c["text"]
                    lps = c.get("logprobs") or {}
                    acc["lps"] += [round(x, 4) for x in lps.get("token_logprobs") or []]
                    acc["tokens"] += lps.get("tokens") or []
                    acc["offsets"] = acc.get("offsets", []) + (lps.get("text_offset") or [])
                acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
    return {"choices": [{"index": i, **c} for i, c in sorted(choices.items())],
            "usage": usage}


def normalize(answer: dict) -> list[tuple]:
    out = []
    for c in sorted(answer["choices"], key=lambda c: c["index"]):
        if "lps" in c:
            out.append((c["index"], c["text"], c["finish_reason"], c["tokens"], c["lps"]))
            continue
        lp = c.get("logprobs") or {}
        text = c["text"] if "text" in c else c["message"]["content"]
        lps = lp.get("token_logprobs") or [e["logprob"] for e in lp.get("content") or []]
        tokens = lp.get("tokens") or [e["token"] for e in lp.get("content") or []]
        out.append((c["index"], text, c["finish_reason"], tokens,
                    [round(x, 4) for x in lps]))
    return out
