"""How long `duet simulate` takes for 10,000 requests (the issue's bar: under 30 s here).

    .venv/bin/python benchmarks/sim_speed.py [--profile out/sim/profile-cpu.json]

Runs each case once and prints the simulator's wall time, the simulated serving time, the
steps simulated and the scheduled request-steps per second. Writes JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from duetserve.bench.datasets import make_dataset
from duetserve.bench.token_workload import token_conversations
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.gpu import efficiency_for
from duetserve.sim.profile import load_profile, roofline_profile
from duetserve.sim.run import simulate


def cases(cpu_profile: str | None):
    gpu = roofline_profile("llama-3-8b", "h100-sxm", efficiency_for("h100-sxm"))
    yield ("h100 llama-3-8b, random 256 in / 64 out (bench serve defaults), 20 req/s",
           gpu, "random", "256", "64", 20.0, ClusterSpec(1))
    yield ("h100 llama-3-8b, random 1024:2048 in / 64:256 out, 8 req/s, 2 instances",
           gpu, "random", "1024:2048", "64:256", 8.0, ClusterSpec(2))
    yield ("h100 llama-3-8b, same, 1P1D over NVLink", gpu, "random", "1024:2048", "64:256",
           8.0, ClusterSpec(num_prefill=1, num_decode=1))
    yield ("h100 llama-3-8b, chat 3 turns 64:256 / 64:256, 3,334 conversations, 10 conv/s",
           gpu, "chat", "64:256", "64:256", 10.0, ClusterSpec(1))
    if cpu_profile:
        cpu = load_profile(cpu_profile)
        yield ("this CPU (calibrated), random 32:128 in / 16:64 out, 0.5 req/s", cpu,
               "random", "32:128", "16:64", 0.5, ClusterSpec(1))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default=None, help="a calibrated CPU profile to time too")
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name, profile, dataset, inp, outp, rate, cluster in cases(args.profile):
        n = args.num_requests // 3 + (dataset == "chat") if dataset == "chat" else args.num_requests
        convs = token_conversations(make_dataset(dataset, num_prompts=n, input_len=inp,
                                                 output_len=outp, num_turns=3, seed=0))
        t0 = time.perf_counter()
        res = simulate(convs, profile, cluster, rate)
        wall = time.perf_counter() - t0
        steps = sum(i["num_steps"] for i in res.instances)
        row = {"case": name, "requests": len(res.records), "wall_s": wall,
               "simulated_s": res.duration_s, "steps": steps,
               "steps_per_s": steps / wall}
        rows.append(row)
        print(f"{name}: {row['requests']} requests, {steps} steps, simulated "
              f"{res.duration_s:.0f} s of serving in {wall:.1f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
