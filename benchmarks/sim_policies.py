"""Scheduling policies compared in the simulator (issue 62): FCFS (the step-time target
alone, arrival order) against the goodput-first SLO-slack policy (core/slo.py), on the
bench datasets at three loads, each step priced by a stated step-time model. The
simulator is deterministic given its model, so this reruns anywhere (no clock read).

    PYTHONPATH=. .venv/bin/python benchmarks/sim_policies.py [--num-prompts 200]
        [--profile PROFILE.json] [--output-json out/sim_policies.json]
        [--plot-cdf docs/sim_policies_cdf.png]

--plot-cdf draws, for each model and dataset at its middle load, the CDFs of TTFT and
TPOT under each policy (one row of two panels per model and dataset).

Without --profile it uses two models written out below, shaped from the figures in
docs/performance.md for this 2-core CPU (not calibrated: `duet simulate --calibrate` on a
quiet machine gives the measured ones, and --profile runs the same table on them):
Qwen2.5-Coder-1.5B Q4_K_M (batch-1 decode ~31 ms, 512-token prefill ~3.8 s) and
SmolLM2-135M (batch-1 decode ~5 ms, 64 streams ~85 ms, 512-token prefill ~0.44 s).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from duetserve.bench.bench_metrics import summarize
from duetserve.bench.datasets import make_dataset
from duetserve.bench.token_workload import token_conversations
from duetserve.core.slo import SloPolicy
from duetserve.core.step_time import Layout, StepTime
from duetserve.request import Request
from duetserve.sim.cluster import ClusterSpec
from duetserve.sim.profile import SimProfile, calibrated_profile, load_profile
from duetserve.sim.run import simulate

LAYOUT = Layout(few_rows=16, chunk_rows=64, masked_max_scores=58254)
RANDOM, CHAT = "random 32-256 in, 32-128 out", "chat, 3 turns"
# model: (step time, KV blocks, {dataset: three loads, conversations/s})
MODELS = {
    "qwen2.5-coder-1.5b-like": (StepTime.of(
        LAYOUT, few_step=0.029, few_row=0.0018, mixed_step=0.035, mixed_row=0.0025,
        many_step=0.060, many_row=0.0068, logit=0.0015, decode_kv=5e-8, decode_kv_reread=5e-8,
        fresh_pair=1.5e-6, chunk_score=3e-9, chunk_pair=1.5e-6), 2340,
        {RANDOM: (0.25, 1.0, 2.0), CHAT: (0.1, 0.25, 0.5)}),
    "smollm2-135m-like": (StepTime.of(
        LAYOUT, few_step=0.004, few_row=0.0003, mixed_step=0.008, mixed_row=0.0004,
        many_step=0.012, many_row=0.0008, logit=0.00005, decode_kv=2e-8, decode_kv_reread=2e-8,
        fresh_pair=5e-7, chunk_score=3e-9, chunk_pair=1e-9), 4096,
        {RANDOM: (2.0, 8.0, 16.0), CHAT: (1.0, 2.0, 4.0)}),
}
DATASETS = {   # the peers run's random mix (issue 62) and 3-turn chat
    RANDOM: dict(name="random", input_len="32:256", output_len="32:128"),
    CHAT: dict(name="chat", input_len="32:256", output_len="32:128", num_turns=3),
}
# fcfs: the step-time target alone, arrival order; slo: core/slo.py; slo+oracle: the SLO
# policy with waiting requests ordered by their true total length, prompt + output
# (shortest first): an upper bound on what output-length prediction could buy there;
# slo+prompt: the same order by prompt length alone, which needs no prediction
# slo+agingW: the SLO policy's deadline plus W times the prompt's own prefill time (the
# step-time model's price of the whole prompt alone): short prompts go first, but only
# by their prefill-time difference x W, so a long prompt is never passed by requests that
# arrived more than that much later (shortest-prompt-first with aging)
POLICIES = ("fcfs", "slo", "slo+prompt", "slo+oracle", "slo+aging1", "slo+aging4")


class OracleOrder(SloPolicy):
    """The SLO policy, its waiting order by true request length (the simulated requests'
    max_tokens is their output length: ignore_eos)."""

    def deadline(self, request: Request) -> float:
        return float(request.num_prompt_tokens + (request.max_tokens or 0))


class PromptOrder(SloPolicy):
    """The SLO policy, its waiting order by prompt length (shortest first)."""

    def deadline(self, request: Request) -> float:
        return float(request.num_prompt_tokens)
class AgingOrder(SloPolicy):
    """The SLO policy's deadline + WEIGHT x the prompt's prefill time (POLICIES)."""

    WEIGHT = 1.0

    def deadline(self, request: Request) -> float:
        prefill_s = self.budget.step_ms(0, request.num_prompt_tokens) / 1e3
        return super().deadline(request) + self.WEIGHT * prefill_s


class Aging1(AgingOrder):
    WEIGHT = 1.0


class Aging4(AgingOrder):
    WEIGHT = 4.0


SLO_MS = {"ttft": 2000.0, "tpot": 100.0}     # duet serve's default targets


def profile_of(name: str, step_time: StepTime, num_blocks: int) -> SimProfile:
    sched = {"max_num_batched_tokens": 2048, "max_num_seqs": 128, "num_blocks": num_blocks,
             "block_size": 16, "max_model_len": 4096, "enable_prefix_caching": True,
             "step_time": step_time.to_json(), "max_step_ms": None}
    return calibrated_profile(name, step_time, sched, {"source": "benchmarks/sim_policies.py"})


def run_cell(profile: SimProfile, dataset: dict, rate: float, policy: str,
             num_prompts: int) -> dict:
    ds = dict(dataset)
    convs = token_conversations(make_dataset(ds.pop("name"), num_prompts=num_prompts,
                                             seed=0, **ds))
    config = profile.scheduler_config(scheduling_policy=policy.split("+")[0])
    order = {"slo+oracle": OracleOrder, "slo+prompt": PromptOrder, "slo+aging1": Aging1,
             "slo+aging4": Aging4}.get(policy)
    if order is not None:
        config = replace(config, slo=order(config.slo.budget, config.slo.targets))
    result = simulate(convs, profile, ClusterSpec(1), rate, config=config)
    s = summarize(result.records, result.duration_s, (50, 99), SLO_MS)
    ok = [r for r in result.records if r.success]
    return {"ttft_s": [r.ttft for r in ok if r.ttft is not None],
            "tpot_s": [r.tpot for r in ok if r.tpot is not None],
            "goodput": s["goodput"], "good": s["good_requests"],
            "completed": s["completed"], "out_tok_s": s["output_throughput"],
            "ttft_p50": s["ttft_ms"]["median"], "ttft_p99": s["ttft_ms"]["p99"],
            "tpot_p50": s["tpot_ms"]["median"], "tpot_p99": s["tpot_ms"]["p99"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--profile", default=None, help="a sim profile JSON instead of the two "
                   "written-out models (rates: --rates)")
    p.add_argument("--rates", default=None, help="comma list of 3 rates (conversations/s) "
                   "for --profile")
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--plot-cdf", default=None, help="PNG of the TTFT and TPOT CDFs per "
                   "policy at each model's and dataset's middle load")
    args = p.parse_args(argv)
    if args.profile:
        prof = load_profile(args.profile)
        rates = tuple(float(x) for x in (args.rates or "0.25,1,2").split(","))
        profiles = [(prof, {ds: rates for ds in DATASETS})]
    else:
        profiles = [(profile_of(n, st, nb), rates) for n, (st, nb, rates) in MODELS.items()]
    rows, middle = [], {}
    print(f"goodput: req/s with TTFT <= {SLO_MS['ttft']:g} ms and TPOT <= "
          f"{SLO_MS['tpot']:g} ms; latencies in ms")
    print("| model | dataset | rate | policy | goodput (good/all) | out tok/s | TTFT p50 / p99 "
          "| TPOT p50 / p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for prof, rates in profiles:
        for ds_name, ds in DATASETS.items():
            for rate in rates[ds_name]:
                for policy in POLICIES:
                    c = run_cell(prof, ds, rate, policy, args.num_prompts)
                    cdfs = {k: c.pop(k) for k in ("ttft_s", "tpot_s")}
                    rows.append({"model": prof.name, "dataset": ds_name, "rate": rate,
                                 "policy": policy, **c})
                    if rate == rates[ds_name][1]:
                        middle.setdefault((prof.name, ds_name, rate), {})[policy] = cdfs
                    print(f"| {prof.name} | {ds_name} | {rate:g} | {policy} | "
                          f"{c['goodput']:.3f} ({c['good']}/{c['completed']}) | "
                          f"{c['out_tok_s']:.1f} | {c['ttft_p50']:.0f} / {c['ttft_p99']:.0f} | "
                          f"{c['tpot_p50']:.0f} / {c['tpot_p99']:.0f} |", flush=True)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({"slo_ms": SLO_MS, "rows": rows}, indent=1))
    if args.plot_cdf:
        plot_cdfs(middle, args.plot_cdf)
    return 0


def plot_cdfs(middle: dict, path: str) -> None:
    """TTFT and TPOT CDFs per policy, one row per (model, dataset, middle rate)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from duetserve.bench.plot import _cdf, save_figure
    fig, axes = plt.subplots(len(middle), 2, figsize=(11, 3.2 * len(middle)), squeeze=False)
    for row, ((model, ds_name, rate), by_policy) in zip(axes, middle.items()):
        for policy, cdfs in by_policy.items():
            _cdf(row[0], cdfs["ttft_s"], policy)
            _cdf(row[1], cdfs["tpot_s"], policy)
        for ax, what, slo in zip(row, ("TTFT", "TPOT"), ("ttft", "tpot")):
            ax.axvline(SLO_MS[slo], color="grey", linestyle=":", linewidth=1)
            ax.set_xscale("log")
            ax.set_xlabel(f"{what} (ms, log; dotted: the SLO)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{model}, {ds_name.split(',')[0]}, {rate:g} conv/s: {what}",
                         fontsize="small")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize="x-small")
    fig.tight_layout()
    print(f"wrote {save_figure(fig, path)}")


if __name__ == "__main__":
    sys.exit(main())
