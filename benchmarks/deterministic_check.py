"""Does a server give the same greedy answer every time? One chat prompt alone, again (a
prefix-cache hit), and as the 4th of 8 concurrent requests, against a running
`duet serve` or `duet router` (docs/deterministic.md). Prints one JSON line: whether the
three answers are equal, and a digest of the first to compare servers by.

    .venv/bin/python benchmarks/deterministic_check.py --base-url http://127.0.0.1:8000
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json

import httpx

PROMPT = "Give three tips for writing clear emails."
OTHERS = [f"Write a short story about a {w} who learns to code." for w in
          ("cat", "dog", "robot", "pirate", "wizard", "farmer", "chef")]


async def ask(client: httpx.AsyncClient, base: str, text: str, max_tokens: int) -> str:
    r = await client.post(f"{base}/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": text}], "temperature": 0,
        "max_tokens": max_tokens})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient() as c:
        alone = await ask(c, base, PROMPT, args.max_tokens)
        again = await ask(c, base, PROMPT, args.max_tokens)
        batch = await asyncio.gather(*[ask(c, base, t, args.max_tokens)
                                       for t in OTHERS[:3] + [PROMPT] + OTHERS[3:]])
    print(json.dumps({"base_url": base, "again_equal": again == alone,
                      "in_batch_equal": batch[3] == alone,
                      "sha256": hashlib.sha256(alone.encode()).hexdigest()[:12],
                      "answer_start": alone[:60]}))


if __name__ == "__main__":
    asyncio.run(main())
