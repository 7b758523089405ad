"""`duet simulate`: the real scheduler driven by a step-time model instead of a model runner.

    duet simulate --calibrate                         # measure this machine, save a profile
    duet simulate --dataset chat --request-rate 0.5   # simulate on it, like duet bench serve
    duet simulate --hardware h100-sxm --model llama-3-8b --pd 1P1D --link ib-ndr ...

Takes `duet bench serve`'s load, dataset and report flags and prints and writes the same
tables and JSON (`duet bench plot` draws simulated and measured runs together).
"""
from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import Any

from duetserve.bench import serve as bench_serve
from duetserve.bench.bench_metrics import write_json
from duetserve.config import DTYPES, SCHEDULING_POLICIES, ConfigError
from duetserve.entrypoints.cli import UserError

PD_PATTERN = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """Cost-model and scheduler flags (shared with `duet plan`)."""
    from duetserve.sim.cluster import LINKS, ROUTERS
    g = p.add_argument_group("step-time model")
    g.add_argument("--profile", default=None, help="profile JSON (from --calibrate or "
                   "--write-profile); default: this machine's calibrated profile")
    g.add_argument("--hardware", default=None, help="GPU from the roofline hardware table "
                   "(h100-sxm, h200, a100-80gb, l40s, ...): a roofline profile for --model")
    g.add_argument("--model", default=None, help="known model name for --hardware (e.g. "
                   "llama-3-8b); checkpoint for --calibrate (default: the default model)")
    g.add_argument("--mfu", type=float, default=None, help="GPU efficiency: fraction of peak "
                   "FLOP/s reached (default per GPU, see sim/gpu.py)")
    g.add_argument("--mbu", type=float, default=None, help="GPU efficiency: fraction of peak "
                   "memory bandwidth reached")
    g.add_argument("--step-overhead-ms", type=float, default=None)
    g.add_argument("--request-overhead-ms", type=float, default=None)
    g.add_argument("--write-profile", default=None, metavar="PATH",
                   help="save the profile in use (edit a GPU profile's factors, then --profile)")
    g = p.add_argument_group("scheduler (overrides the profile's settings)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="fixed token budget per step (as the engine's flag: no per-step "
                   "budget from the running decodes)")
    g.add_argument("--max-step-ms", type=float, default=None,
                   help="fixed step-time target of the per-step budget (as the engine's "
                   "flag; needs a calibrated profile, which carries the engine's step time)")
    g.add_argument("--scheduling-policy", choices=list(SCHEDULING_POLICIES), default=None,
                   help="the engine's --scheduling-policy (default: slo, with a profile "
                        "that carries the engine's step time; a fixed budget is fcfs)")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="the engine's --slo-ttft-ms, the target its scheduler plans for "
                        "(--slo sets what goodput is measured against)")
    g.add_argument("--slo-tpot-ms", type=float, default=None, help="the engine's --slo-tpot-ms")
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks per instance")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g = p.add_argument_group("cluster")
    g.add_argument("--router", choices=ROUTERS, default="round_robin")
    g.add_argument("--link", choices=sorted(LINKS), default="nvlink",
                   help="link carrying KV from prefill to decode instances")
    g.add_argument("--link-bandwidth-gbs", type=float, default=None,
                   help="link bandwidth in GB/s (overrides --link's figure)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `duet simulate`."""
    bench_serve.add_load_arguments(p)
    bench_serve.add_dataset_arguments(p)
    bench_serve.add_report_arguments(p)
    add_profile_arguments(p)
    g = p.add_argument_group("topology")
    g.add_argument("--instances", type=int, default=1, help="colocated instances")
    g.add_argument("--pd", default=None, metavar="xPyD",
                   help="disaggregated: x prefill and y decode instances, e.g. 1P2D")
    g.add_argument("--plot", default=None, metavar="PNG", help="draw the bench-serve plots")
    g = p.add_argument_group("calibration")
    g.add_argument("--calibrate", action="store_true",
                   help="measure this machine's engine (probe steps and a serving "
                        "scenario), fit its step time and save a profile")
    g.add_argument("--quick", action="store_true",
                   help="--calibrate on a few probes and a short scenario (smoke runs)")
    g.add_argument("--num-threads", type=int, default=2, help="engine threads (calibration)")
    g.add_argument("--kv-prefault", action="store_true",
                   help="--calibrate engines that map their whole KV cache at start, as "
                        "`duet serve --kv-prefault` does (no first-use page faults)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="--calibrate the engine `duet serve --dtype` this would run")
    g.add_argument("--profile-out", default=None, help="where --calibrate saves the profile")


def resolve_profile(args: argparse.Namespace):
    """The SimProfile the flags name: --profile, else --hardware (roofline), else this
    machine's calibrated profile. UserError when there is none."""
    from duetserve.sim.gpu import efficiency_for
    from duetserve.sim.profile import load_profile, roofline_profile
    try:
        if args.profile:
            return load_profile(args.profile)
        if args.hardware:
            eff = efficiency_for(args.hardware.lower(), mfu=args.mfu, mbu=args.mbu,
                                 step_overhead_ms=args.step_overhead_ms,
                                 request_overhead_ms=args.request_overhead_ms)
            return roofline_profile(args.model or "llama-3-8b", args.hardware, eff)
        from duetserve.entrypoints.sim_calibrate import default_calibrated_path
        path = default_calibrated_path(args.model, args.num_threads)
        if not path.exists():
            raise UserError(f"no calibrated profile at {path}: run `duet simulate --calibrate` "
                            "(or pass --profile / --hardware)")
        return load_profile(path)
    except ConfigError as e:
        raise UserError(str(e)) from None


def scheduler_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_num_batched_tokens": args.max_num_batched_tokens,
            "max_step_ms": args.max_step_ms,
            "max_num_seqs": args.max_num_seqs, "num_blocks": args.num_blocks,
            "block_size": args.block_size, "max_model_len": args.max_model_len,
            "enable_prefix_caching": False if args.no_prefix_caching else None,
            "scheduling_policy": args.scheduling_policy, "slo_ttft_ms": args.slo_ttft_ms,
            "slo_tpot_ms": args.slo_tpot_ms}


def cluster_spec(args: argparse.Namespace, pd: str | None = None, instances: int = 1):
    from duetserve.sim.cluster import ClusterSpec
    num_p = num_d = 0
    if pd:
        m = PD_PATTERN.match(pd.strip())
        if not m:
            raise UserError(f"--pd {pd!r}: expected xPyD, e.g. 1P2D")
        num_p, num_d = int(m.group(1)), int(m.group(2))
    bw = args.link_bandwidth_gbs * 1e9 if args.link_bandwidth_gbs else None
    try:
        return ClusterSpec(instances, num_p, num_d, args.router, args.link, bw)
    except ConfigError as e:
        raise UserError(str(e)) from None


def scheduler_json(config) -> dict[str, Any]:
    """A SchedulerConfig for the results document (its StepBudget described)."""
    out = {f.name: getattr(config, f.name) for f in fields(config)
           if f.name not in ("step_budget", "spec_policy", "slo")}
    out["step_budget"] = None if config.step_budget is None else config.step_budget.describe()
    out["scheduling"] = "fcfs" if config.slo is None else config.slo.describe()
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Simulate every requested rate; returns the results document (bench serve's)."""
    from duetserve.bench.bench_metrics import format_summary
    from duetserve.bench.token_workload import token_conversations
    from duetserve.sim.run import run_json, simulate
    profile = resolve_profile(args)
    if args.write_profile:
        print(f"wrote {profile.save(args.write_profile)}")
    try:
        config = profile.scheduler_config(**scheduler_overrides(args))
        slo = bench_serve.parse_slo(args.slo)
        percentiles = bench_serve.parse_floats(args.percentiles, "--percentiles")
        rates = (bench_serve.parse_floats(args.sweep_rates, "--sweep-rates")
                 if args.sweep_rates else [args.request_rate])
        convs = token_conversations(bench_serve.build_dataset(args))
    except (bench_serve.BenchError, ConfigError) as e:
        raise UserError(str(e)) from None
    cluster = cluster_spec(args, args.pd, args.instances)
    label = args.label or f"simulated ({profile.name})"
    runs = []
    for rate in rates:
        result = simulate(convs, profile, cluster, rate, args.burstiness, args.seed,
                          args.max_concurrency, config)
        entry = run_json(result, bench_serve.rate_json(rate), args.burstiness,
                         args.max_concurrency, percentiles, slo)
        print(format_summary(entry["summary"], f"{label} @ {rate:g} req/s"))
        print(f"simulated {len(result.records)} requests ({entry['summary']['duration_s']:.1f} "
              f"s of serving) in {result.wall_s:.2f} s")
        runs.append(entry)
    if len(runs) > 1:
        print(bench_serve.format_sweep(runs))
    config_json = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"}
    config_json.update(request_rate=bench_serve.rate_json(args.request_rate),
                       rates=[bench_serve.rate_json(r) for r in rates], percentiles=percentiles,
                       slo_ms=slo, simulated=True, profile=profile.name,
                       step_time=profile.step_time.describe(), cluster=cluster.describe(),
                       scheduler=scheduler_json(config))
    return {"schema": bench_serve.SCHEMA, "label": label, "config": config_json, "runs": runs}


def main(args: argparse.Namespace) -> int:
    """Entry point of `duet simulate`."""
    if args.calibrate:
        from duetserve.entrypoints.sim_calibrate import main_calibrate
        return main_calibrate(args)
    doc = run(args)
    if args.output_json:
        print(f"wrote {write_json(args.output_json, doc)}")
    if args.plot:
        from duetserve.bench.plot import plot
        print(f"wrote {plot([(doc['label'], doc)], args.plot)}")
    return 0 if any(r["summary"]["completed"] for r in doc["runs"]) else 1

