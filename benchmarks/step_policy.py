"""The engine's per-step token budget against fixed budgets, on the wall clock.

The same seeded chat conversations and arrival schedule (benchmarks/sim_fidelity.py's chat
mix: 3 turns, 32-128 words in, 32-96 out, each turn sent when the previous one finished)
replayed on a real in-process EngineCore (bench/replay.py, no HTTP) under each policy:
`default` is what `duet serve` does without flags (core/step_budget.StepBudget from the
measured step time), `fixed-N` a fixed --max-num-batched-tokens N. Policies alternate
within each repeat, so a drift of the machine's speed hits them alike. Reported per policy
and rate: medians over the repeats of TTFT and TPOT p50 / p90 / p99, and the engine's busy
fraction (step time / wall time).

    PYTHONPATH=. .venv/bin/python benchmarks/step_policy.py \\
        --rates 0.8 --repeats 3 --out out/step_policy/run
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_fidelity import conversations  # noqa: E402

from duetserve.bench.replay import replay  # noqa: E402
from duetserve.bench.token_workload import arrival_offsets, id_range_for_vocab  # noqa: E402

KEYS = [("ttft", "TTFT"), ("tpot", "TPOT")]


def one_run(loaded, threads: int, budget: int | None, mix: str, rate: float, seconds: float,
            seed: int) -> dict:
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    engine = EngineCore(EngineConfig(num_threads=threads, max_num_batched_tokens=budget),
                        loaded)
    n = max(16, int(round(rate * seconds)))
    convs = conversations(mix, n, seed, id_range_for_vocab(engine.model_config.vocab_size))
    res = replay(engine, convs, arrival_offsets(n, rate, 1.0, seed).tolist())
    out = {"requests": len(res.records), "duration_s": res.duration_s,
           "busy": sum(d for _, d, _ in res.steps) / res.duration_s, "steps": len(res.steps),
           "step_budget": engine.scheduler.config.step_budget.describe()
           if engine.scheduler.config.step_budget else None}
    for key, _ in KEYS:
        vals = [getattr(r, key) for r in res.records if getattr(r, key)]
        for p in (50, 90, 99):
            out[f"{key}_p{p}_ms"] = float(np.percentile(vals, p) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/step_policy/run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mix", default="chat")
    ap.add_argument("--rates", default="0.8", help="conversations/s")
    ap.add_argument("--fixed", default="512", help="fixed budgets to compare")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--run-seconds", type=float, default=45.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    loaded = EngineCore(EngineConfig(num_threads=args.threads)).loaded
    policies = [("default", None)] + [(f"fixed-{b}", int(b)) for b in args.fixed.split(",")]
    runs: dict[str, list[dict]] = {}
    for rate in (float(r) for r in args.rates.split(",")):
        for rep in range(args.repeats):
            for name, budget in policies:
                r = one_run(loaded, args.threads, budget, args.mix, rate, args.run_seconds,
                            args.seed)
                runs.setdefault(f"{name}@{rate:g}", []).append(r)
                print(f"[{time.strftime('%H:%M:%S')}] {name} @ {rate:g}/s run {rep + 1}: "
                      f"TTFT p50 {r['ttft_p50_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.1f} ms, "
                      f"busy {r['busy']:.2f}", file=sys.stderr, flush=True)
    cols = [f"{k}_p{p}_ms" for k, _ in KEYS for p in (50, 90, 99)] + ["busy"]
    table = {key: {c: statistics.median(r[c] for r in rs) for c in cols}
             for key, rs in runs.items()}
    print(f"| policy @ rate | {' | '.join(f'{n} p{p} (ms)' for _, n in KEYS for p in (50, 90, 99))}"
          f" | busy |")
    print("|---" * (len(cols) + 1) + "|")
    for key, row in table.items():
        print(f"| {key} | " + " | ".join(f"{row[c]:.0f}" if c.startswith("ttft") else
                                         f"{row[c]:.1f}" if c.startswith("tpot") else
                                         f"{row[c]:.2f}" for c in cols) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_policy.json").write_text(json.dumps(
        {"args": vars(args), "medians": table, "runs": runs}, indent=1))
    print(f"wrote {out / 'step_policy.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
