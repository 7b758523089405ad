"""Draft-model acceptance of seeded (coupled) vs unseeded (rejection-sampled) requests.

Seeded sampled requests are verified by coupling (spec_decode/rejection.py): the draft
proposes its inverse-CDF sample at the uniform the target uses for that position, and a
draft is kept iff both land on the same token, so a seeded request's tokens do not depend
on the number of drafts. Rejection sampling keeps a draft with probability min(1, p/q),
whose expectation sum min(p, q) is the best any verifier can do; coupling can fall short
of it. This measures by how much, on the issue's pair (Qwen2.5-Coder-0.5B drafting for
the 1.5B) and chat prompts: k fixed, batch 1, the same prompts seeded and unseeded.
Acceptance depends on the distributions, not on timing.

    python benchmarks/spec_seeded_acceptance.py --out out/spec_seeded.json

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from duetserve.config import EngineConfig
from duetserve.engine.engine_core import EngineCore
from duetserve.engine.llm import LLM
from duetserve.loader import load_model
from duetserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_decode import CHAT_PROMPTS, DRAFT, TARGET  # noqa: E402


def _acceptance(llm: LLM, params: list[SamplingParams]) -> dict:
    s0 = llm.engine.scheduler.make_stats().spec
    for conv, p in zip(CHAT_PROMPTS * (len(params) // len(CHAT_PROMPTS)), params):
        llm.chat(conv, p)
    s1 = llm.engine.scheduler.make_stats().spec
    drafted = s1.num_draft_tokens - s0.num_draft_tokens
    accepted = s1.num_accepted_tokens - s0.num_accepted_tokens
    drafts = s1.num_drafts - s0.num_drafts
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--samples", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--settings", default="0.7:0.95,1.0:1.0", help="temperature:top_p,...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="spec_seeded_acceptance.json")
    args = ap.parse_args()
    loaded = load_model(args.model)
    cfg = EngineConfig(model=loaded.path, num_threads=args.threads, kv_cache_memory=0.5,
                       max_num_batched_tokens=2048, enable_prefix_caching=False,
                       speculative_config={"method": "draft", "model": args.draft,
                                           "num_speculative_tokens": args.k,
                                           "adaptive": False})
    llm = LLM.from_engine(EngineCore(cfg, loaded=loaded))
    rows = []
    n = len(CHAT_PROMPTS) * args.samples
    for setting in args.settings.split(","):
        t, top_p = (float(v) for v in setting.split(":"))
        for mode in ("unseeded", "seeded"):
            params = [SamplingParams(temperature=t, top_p=top_p, max_tokens=args.max_tokens,
                                     ignore_eos=True,
                                     seed=None if mode == "unseeded" else 1000 + i)
                      for i in range(n)]
            row = {"temperature": t, "top_p": top_p, "mode": mode, **_acceptance(llm, params)}
            rows.append(row)
            print(f"T={t:<4} top_p={top_p:<5} {mode:9} drafted {row['draft_tokens']:5d} "
                  f"accepted {row['accepted_tokens']:5d}  rate {row['acceptance_rate']:.3f}  "
                  f"mean accepted length {row['mean_accepted_length']:.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
