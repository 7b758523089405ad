"""Does the cost model's row tilt follow the workload or the hour? (docs/simulator.md §3)

In the fidelity runs, decode-heavy steps of one row ran under the fit and steps of 5-16
rows over it, while chat's sat flat (benchmarks/sim_step_kinds.py --by-rows). This
replays four workloads in turn, each on a fresh engine in one process (bench/replay.py, as
the fidelity runs do), for ROUNDS rounds, and prints the same bands for each replay under
one profile: decode-heavy and chat as in benchmarks/sim_fidelity.py, decode-heavy's short
prompts with short outputs, and its long outputs with long prompts. Replays of one round
run minutes apart, so the machine's speed shifts all bands of a row together; a tilt that
follows the workload within a round is the cost model's shape, not the machine.

    /tmp/gate.sh env PYTHONPATH=. .venv/bin/python benchmarks/sim_workload_tilt.py \
        --profile out/sim/r23/profile.json --rounds 2 --out out/sim/tilt.json \
        [--workloads decode-heavy,chat] [--kv lazy,prefault]

--kv replays each workload once per KV cache mode in turn (lazy: mapped on first touch,
4 KiB pages; prefault: written at start, 2 MiB pages; EngineConfig.kv_prefault), so a
change of tilt between them within a round is the cache's pages, not the hour.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sim_fidelity as sf  # noqa: E402 (benchmarks/ is the script's dir)
from sim_step_kinds import band_cells, band_names, row_bands  # noqa: E402

from duetserve.bench.replay import replay
from duetserve.bench.token_workload import arrival_offsets, id_range_for_vocab
from duetserve.sim.profile import load_profile

# (name, dataset settings, rate /s, conversations): about 20-40 s each on SmolLM2, 2 threads
WORKLOADS = (
    ("decode-heavy", sf.MIXES["decode-heavy"], 3.3, 70),
    ("chat", sf.MIXES["chat"], 0.8, 25),
    ("short in, short out", dict(dataset="random", input_len="16:64", output_len="24:48"),
     8.0, 150),
    ("long in, long out", dict(dataset="random", input_len="96:256", output_len="96:192"),
     1.5, 40),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the bands as JSON here")
    ap.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS),
                    help="comma-separated names of WORKLOADS to replay, in this order")
    ap.add_argument("--kv", default="lazy",
                    help="comma-separated KV cache modes to alternate: lazy, prefault")
    args = ap.parse_args()
    by_name = {w[0]: w for w in WORKLOADS}
    if unknown := set(args.workloads.split(",")) - set(by_name):
        ap.error(f"--workloads: unknown {sorted(unknown)} (known: {', '.join(by_name)})")
    workloads = [by_name[w] for w in args.workloads.split(",")]
    modes = args.kv.split(",")
    if set(modes) - {"lazy", "prefault"}:
        ap.error(f"--kv: unknown mode in {args.kv!r} (lazy, prefault)")
    from duetserve.config import EngineConfig
    from duetserve.engine.engine_core import EngineCore
    cost = load_profile(args.profile).cost
    configs = {m: EngineConfig(num_threads=args.threads, kv_prefault=m == "prefault")
               for m in modes}
    first = EngineCore(configs[modes[0]])
    loaded, id_range = first.loaded, id_range_for_vocab(first.model_config.vocab_size)
    del first
    print("| round | workload | KV cache | seconds | " + " | ".join(band_names()) + " |")
    print("|---|---|---|---|" + "---|" * len(band_names()))
    results = []
    for rnd in range(1, args.rounds + 1):
        for name, spec, rate, n in workloads:
            convs = sf.conversations_of(spec, n, 0, id_range)
            for mode in modes:
                engine = EngineCore(configs[mode], loaded)
                res = replay(engine, convs, arrival_offsets(n, rate, 1.0, 0).tolist())
                del engine
                bands = row_bands(cost, [(sl, s, c) for (_, s, sl), c in
                                         zip(res.steps, res.step_cold)])
                print(f"| {rnd} | {name} | {mode} | {res.duration_s:.0f} | "
                      + " | ".join(band_cells(bands)) + " |", flush=True)
                results.append({"round": rnd, "workload": name, "kv": mode,
                                "seconds": res.duration_s,
                                "bands": {f"{lo}-{hi}": v for (lo, hi), v in bands.items()}})
    if args.out:
        Path(args.out).write_text(json.dumps({"profile": args.profile, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
