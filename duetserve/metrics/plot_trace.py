"""`duet plot TRACE.json -o timeline.png`: draw a step trace written by TraceWriter.

Top panel: prefill and decode tokens of every step over time (stacked bars, one bar per
step, as wide as the step). Bottom panel: every step on the roofline of the hardware it
ran on (achieved FLOP/s against arithmetic intensity, log-log), coloured by phase.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from duetserve.config import ConfigError
from duetserve.metrics.hardware import get_hardware, local_profile
from duetserve.metrics.step_accounting import PHASES
from duetserve.metrics.trace import STEPS_TRACK

PHASE_COLOURS = {"prefill": "tab:orange", "decode": "tab:blue", "mixed": "tab:purple"}


def load_steps(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Return (step events of the "engine steps" track sorted by ts, otherData) of a trace.

    Raises ConfigError when the file is not a trace with an engine steps track."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read trace {path!r}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ConfigError(f"{path!r} is not a Chrome trace object (no traceEvents list)")
    events = data["traceEvents"]
    tids = {(e.get("pid"), e.get("tid")) for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
            and e.get("args", {}).get("name") == STEPS_TRACK}
    if not tids:
        raise ConfigError(f"{path!r} has no {STEPS_TRACK!r} track (written by --trace-file?)")
    steps = [e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in tids]
    steps.sort(key=lambda e: e["ts"])
    return steps, data.get("otherData", {}) or {}


def _roofline_of(meta: dict[str, Any], hardware: str | None) -> tuple[str, float, float]:
    """Return (label, peak FLOP/s, bandwidth bytes/s) from --hardware, the trace, or local."""
    if hardware:
        hw = get_hardware(hardware)
        dtype = hw.default_compute
        return f"{hw.name} {dtype}", hw.peak(dtype), hw.mem_bandwidth
    h = meta.get("hardware")
    if h:
        return (f"{h['name']} {h['compute_dtype']}", float(h["peak_flops"]),
                float(h["mem_bandwidth"]))
    hw = local_profile()
    return f"{hw.name} fp32", hw.peak("fp32"), hw.mem_bandwidth


def plot(path: str, out: str, title: str | None = None, hardware: str | None = None) -> None:
    """Draw the two panels of the trace at `path` into the image `out`."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("duet plot needs matplotlib: pip install matplotlib") from None
    steps, meta = load_steps(path)
    if not steps:
        raise ConfigError(f"{path!r} has no steps to plot")
    hw_label, peak, bandwidth = _roofline_of(meta, hardware)

    fig, (ax_t, ax_r) = plt.subplots(2, 1, figsize=(11, 9),
                                     gridspec_kw={"height_ratios": [1, 1.2]})
    t = [e["ts"] / 1e6 for e in steps]
    w = [max(e.get("dur", 0) / 1e6, 1e-6) for e in steps]
    pre = [e["args"].get("prefill_tokens", 0) for e in steps]
    dec = [e["args"].get("decode_tokens", 0) for e in steps]
    ax_t.bar(t, pre, width=w, align="edge", color=PHASE_COLOURS["prefill"],
             label="prefill tokens", linewidth=0)
    ax_t.bar(t, dec, width=w, bottom=pre, align="edge", color=PHASE_COLOURS["decode"],
             label="decode tokens", linewidth=0)
    ax_t.set_xlabel("time since start (s)")
    ax_t.set_ylabel("tokens per step")
    ax_t.set_title(f"tokens per engine step ({len(steps)} steps; bar width = step duration)")
    ax_t.legend(loc="upper right")
    ax_t.grid(axis="y", alpha=0.3)

    points = [(e["args"]["flops"] / e["args"]["bytes"], e["args"]["flops_per_s"], e["name"])
              for e in steps if e["args"].get("flops") and e["args"].get("bytes")
              and e["args"].get("flops_per_s")]
    _draw_roofline(ax_r, points, peak, bandwidth, hw_label)
    fig.suptitle(title or meta.get("title") or f"duetserve step timeline: {path}",
                 fontsize=13)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _draw_roofline(ax: Any, points: list[tuple[float, float, str]], peak: float,
                   bandwidth: float, hw_label: str) -> None:
    """Log-log roofline min(peak, AI x bandwidth) and one dot per step, by phase."""
    ridge = peak / bandwidth
    ais = [p[0] for p in points] or [ridge]
    lo, hi = min(min(ais), ridge) / 3, max(max(ais), ridge) * 3
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(peak, x * bandwidth) for x in xs], color="black", linewidth=1.5,
            label=f"roofline: {hw_label} {peak / 1e9:.0f} GFLOP/s, {bandwidth / 1e9:.0f} GB/s")
    ax.axvline(ridge, color="grey", linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.1f} FLOP/B", (ridge, peak), textcoords="offset points",
                xytext=(4, -14), fontsize=8, color="grey")
    for phase in PHASES:
        sel = [p for p in points if p[2] == phase]
        if sel:
            ax.scatter([p[0] for p in sel], [p[1] for p in sel], s=14, alpha=0.7,
                       color=PHASE_COLOURS[phase], label=f"{phase} steps ({len(sel)})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title("steps on the roofline (achieved, from the cost model and step time)")
    ax.grid(which="both", alpha=0.2)
    ax.legend(loc="lower right", fontsize=9)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `duet plot` options to `parser`."""
    parser.add_argument("trace", help="trace JSON written by --trace-file (TraceWriter)")
    parser.add_argument("-o", "--output", default="timeline.png", help="image to write")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--hardware", default=None,
                        help="roofline of this profile (default: the one in the trace)")


def main(args: argparse.Namespace) -> int:
    """Run `duet plot`; return the exit code (2 on a user error)."""
    try:
        plot(args.trace, args.output, args.title, args.hardware)
    except ConfigError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


__all__ = ["add_arguments", "main", "plot", "load_steps"]
