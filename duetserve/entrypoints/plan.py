"""`duet plan`: which deployment gives the most goodput per GPU under TTFT/TPOT SLOs.

    duet plan --model llama-3-8b --hardware h100-sxm --workload prefill-heavy \\
              --slo ttft=400 tpot=40 --attainment 90 --max-gpus 4 --plot plan.png

Searches colocated (instances x chunk size) against disaggregated (xPyD) deployments with
the simulator (sim/plan.py) and prints, per candidate, the highest rate at which the SLO
attainment holds and that rate per GPU, DistServe-style.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from duetserve.bench import serve as bench_serve
from duetserve.bench.bench_metrics import write_json
from duetserve.bench.plot import save_figure
from duetserve.config import ConfigError
from duetserve.entrypoints.cli import UserError
from duetserve.entrypoints.simulate import add_profile_arguments, resolve_profile

# GPU-scale workloads: (dataset flags, default SLO in ms)
WORKLOADS: dict[str, tuple[dict[str, Any], dict[str, float]]] = {
    # long prompts, short answers (summarization-like; DistServe's LongBench case)
    "prefill-heavy": ({"dataset": "random", "input_len": "1536:2560", "output_len": "32:128"},
                      {"ttft": 400.0, "tpot": 40.0}),
    # short prompts, long answers (chatbot / generation-like)
    "decode-heavy": ({"dataset": "random", "input_len": "128:512", "output_len": "256:768"},
                     {"ttft": 200.0, "tpot": 25.0}),
    # multi-turn chat: each turn resends the history (prefix caching matters)
    "chat": ({"dataset": "chat", "input_len": "64:256", "output_len": "64:256", "num_turns": 3},
             {"ttft": 250.0, "tpot": 30.0}),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `duet plan`."""
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="a preset (sets the dataset flags and a default SLO)")
    g.add_argument("--num-prompts", type=int, default=400, help="requests per simulation")
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    bench_serve.add_dataset_arguments(p)
    add_profile_arguments(p)
    g = p.add_argument_group("search")
    g.add_argument("--slo", nargs="*", default=[], metavar="KEY=MS",
                   help="ttft=MS tpot=MS (default: the workload preset's)")
    g.add_argument("--attainment", type=float, default=90.0,
                   help="percent of requests that must meet both SLOs (default 90)")
    g.add_argument("--max-gpus", type=int, default=4)
    g.add_argument("--colocated-instances", default="1,2", help="comma list of N")
    g.add_argument("--chunks", default="256,512,1024,2048,8192",
                   help="colocated token budgets per step to try")
    g.add_argument("--prefill-chunk", type=int, default=8192,
                   help="token budget of prefill instances (disaggregated)")
    g.add_argument("--rel-tol", type=float, default=0.03, help="bisection tolerance on the rate")
    g = p.add_argument_group("report")
    g.add_argument("--output-json", default=None)
    g.add_argument("--plot", default=None, metavar="PNG")
    g.add_argument("--no-progress", action="store_true")


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers") from None


def _apply_preset(args: argparse.Namespace) -> dict[str, float]:
    """Dataset flags from --workload (explicit flags left at their defaults are replaced);
    returns the preset's default SLO (empty without a preset)."""
    if not args.workload:
        return {}
    flags, slo = WORKLOADS[args.workload]
    for key, value in flags.items():
        setattr(args, key, value)
    return slo


def format_table(title: str, results: list) -> str:
    head = (f"{'mode':<15}{'deployment':<18}{'GPUs':>5}{'max rate':>10}{'goodput/GPU':>13}"
            f"{'TTFT p90':>10}{'TPOT p90':>10}")
    lines = [title, head, "-" * len(head)]
    for r in results:
        ev = r.at_max()
        cells = ["-" if ev is None or v is None else f"{v:.1f}"
                 for v in ((ev.ttft_p90_ms, ev.tpot_p90_ms) if ev else (None, None))]
        lines.append(f"{r.candidate.mode:<15}{r.candidate.name:<18}"
                     f"{r.candidate.cluster.num_gpus:>5}{r.max_rate:>10.3f}"
                     f"{r.goodput_per_gpu:>13.3f}{cells[0]:>10}{cells[1]:>10}")
    best = {}
    for r in results:
        if r.candidate.mode not in best or r.goodput_per_gpu > best[r.candidate.mode].goodput_per_gpu:
            best[r.candidate.mode] = r
    lines.append("-" * len(head))
    for mode, r in best.items():
        lines.append(f"best {mode}: {r.candidate.name}, {r.goodput_per_gpu:.3f} req/s per GPU")
    if len(best) == 2 and best["colocated"].goodput_per_gpu > 0:
        ratio = best["disaggregated"].goodput_per_gpu / best["colocated"].goodput_per_gpu
        lines.append(f"disaggregated / colocated goodput per GPU: {ratio:.2f}x")
    return "\n".join(lines)


def plot(results: list, curves: dict[str, list], path: str, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 4.8))
    names = [r.candidate.name for r in results]
    colors = ["C0" if r.candidate.mode == "colocated" else "C1" for r in results]
    ax0.barh(names, [r.goodput_per_gpu for r in results], color=colors)
    ax0.invert_yaxis()
    ax0.set_xlabel("goodput per GPU (req/s at which the SLO attainment holds)")
    ax0.set_title("colocated (blue) vs disaggregated (orange)")
    for name, (gpus, evs) in curves.items():
        ax1.plot([e.rate / gpus for e in evs], [e.attainment * 100 for e in evs], marker="o",
                 label=name)
    ax1.set_xlabel("request rate per GPU (req/s)")
    ax1.set_ylabel("SLO attainment (%)")
    ax1.set_title("attainment of the best of each mode")
    ax1.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def best_curves(planner, results) -> dict:
    """{"MODE: deployment": (gpus, evaluations)}: the attainment curve of each mode's best
    deployment (most goodput per GPU), from a quarter to twice its max rate."""
    curves = {}
    for mode in ("colocated", "disaggregated"):
        ranked = sorted((r for r in results if r.candidate.mode == mode),
                        key=lambda r: -r.goodput_per_gpu)
        if ranked and ranked[0].max_rate > 0:
            best = ranked[0]
            rates = [best.max_rate * f for f in (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)]
            curves[f"{mode}: {best.candidate.name}"] = (
                best.candidate.cluster.num_gpus, planner.attainment_curve(best.candidate, rates))
    return curves


def main(args: argparse.Namespace) -> int:
    """Entry point of `duet plan`."""
    from duetserve.bench.token_workload import token_conversations
    from duetserve.entrypoints.simulate import cluster_spec, scheduler_overrides
    from duetserve.sim.plan import SLO, Planner, candidates
    preset_slo = _apply_preset(args)
    try:
        slo_ms = {**preset_slo, **bench_serve.parse_slo(args.slo)}
        convs = token_conversations(bench_serve.build_dataset(args))
    except bench_serve.BenchError as e:
        raise UserError(str(e)) from None
    if not {"ttft", "tpot"} <= set(slo_ms):
        raise UserError("duet plan needs --slo ttft=MS tpot=MS (or a --workload preset)")
    if not 0 < args.attainment <= 100:
        raise UserError(f"--attainment must be in (0, 100], got {args.attainment}")
    profile = resolve_profile(args)
    overrides = scheduler_overrides(args)
    overrides["max_num_batched_tokens"] = None
    try:
        profile.scheduler.update({k: v for k, v in overrides.items() if v is not None})
        profile.scheduler_config()
    except ConfigError as e:
        raise UserError(str(e)) from None
    slo = SLO(slo_ms["ttft"], slo_ms["tpot"], args.attainment / 100)
    say = None if args.no_progress else (lambda m: print(m, file=sys.stderr, flush=True))
    planner = Planner(convs, profile, slo, args.seed, args.burstiness, args.rel_tol, say)
    cands = candidates(args.max_gpus, _ints(args.colocated_instances, "--colocated-instances"),
                       _ints(args.chunks, "--chunks"), args.prefill_chunk,
                       cluster_spec(args))
    results = [planner.max_rate(c) for c in cands]
    title = (f"duet plan: {profile.description} [{profile.step_time.describe()}]\n"
             f"workload {args.workload or args.dataset} (input {args.input_len}, output "
             f"{args.output_len}, {args.num_prompts} requests); SLO: "
             f"{args.attainment:g}% of requests with TTFT <= {slo.ttft_ms:g} ms and TPOT <= "
             f"{slo.tpot_ms:g} ms")
    print(format_table(title, results))
    curves = best_curves(planner, results)
    doc = {"schema": "duet-plan/1", "title": title, "profile": profile.to_json(),
           "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms,
                   "attainment": slo.attainment},
           "workload": {k: getattr(args, k) for k in ("workload", "dataset", "input_len",
                                                      "output_len", "num_prompts", "seed")},
           "results": [{"mode": r.candidate.mode, "deployment": r.candidate.name,
                        "gpus": r.candidate.cluster.num_gpus, "chunk": r.candidate.chunk,
                        "max_rate": r.max_rate, "goodput_per_gpu": r.goodput_per_gpu,
                        "evaluations": [vars(e) for e in r.evaluations]} for r in results],
           "curves": {k: {"gpus": g, "points": [vars(e) for e in evs]}
                      for k, (g, evs) in curves.items()}}
    if args.output_json:
        print(f"wrote {write_json(args.output_json, doc)}")
    if args.plot:
        print(f"wrote {plot(results, curves, args.plot, title)}")
    return 0
