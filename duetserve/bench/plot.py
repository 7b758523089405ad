"""`duet bench plot`: plots from the JSON written by `duet bench serve --output-json`.

    duet bench plot a.json [b.json ...] -o out.png

Top row: CDFs of TTFT, TPOT and E2E latency per request, one curve per run (legend = the run's
--label stored in the JSON, else the file name; sweep runs add "@ rate"). When any file
holds a rate sweep, a second row plots against the offered request rate: TTFT p50/p99,
TPOT p50/p99 and goodput (or achieved request throughput when no SLO was given). Runs at
rate inf have no place on a rate axis and appear only in the CDFs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags of `duet bench plot`."""
    p.add_argument("results", nargs="+", help="JSON files from duet bench serve --output-json")
    p.add_argument("-o", "--output", default="bench.png", help="image to write (default %(default)s)")
    p.add_argument("--labels", default=None, help="comma list overriding the legend names, one per file")
    p.add_argument("--title", default=None, help="figure title")


def load_results(paths: list[str], labels: list[str] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(label, document) per file; label = --labels entry, else the stored label, else the stem."""
    out = []
    for i, path in enumerate(paths):
        doc = json.loads(Path(path).read_text())
        if "runs" not in doc:
            raise ValueError(f"{path}: not a duet bench serve result (no 'runs')")
        label = labels[i] if labels and i < len(labels) else doc.get("label") or Path(path).stem
        out.append((label, doc))
    return out


def _rate(run: dict[str, Any]) -> float:
    r = run["request_rate"]
    return float("inf") if r in ("inf", None) else float(r)


def _cdf(ax: Any, values_s: list[float], label: str) -> None:
    if not values_s:
        return
    ms = np.sort(np.asarray(values_s, dtype=np.float64)) * 1000.0
    ax.step(ms, np.arange(1, len(ms) + 1) / len(ms), where="post", label=label)


def _plot_cdfs(axes: list[Any], docs: list[tuple[str, dict[str, Any]]]) -> None:
    for label, doc in docs:
        for run in doc["runs"]:
            name = label if len(doc["runs"]) == 1 else f"{label} @ {_rate(run):g} req/s"
            ok = [r for r in run["requests"] if r["success"]]
            _cdf(axes[0], [r["ttft"] for r in ok if r["ttft"] is not None], name)
            _cdf(axes[1], [r["tpot"] for r in ok if r["tpot"] is not None], name)
            _cdf(axes[2], [r["e2e"] for r in ok if r["e2e"] is not None], name)
    for ax, what in zip(axes, ("TTFT", "TPOT", "E2E latency")):
        ax.set_xlabel(f"{what} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{what} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")


def _plot_sweeps(axes: list[Any], docs: list[tuple[str, dict[str, Any]]]) -> None:
    for i, (label, doc) in enumerate(docs):
        color = f"C{i % 10}"  # one color per file across the three axes
        runs = sorted((r for r in doc["runs"] if np.isfinite(_rate(r))), key=_rate)
        if not runs:
            continue
        x = [_rate(r) for r in runs]

        def col(key: str, stat: str) -> list[float]:
            return [np.nan if r["summary"][key].get(stat) is None else r["summary"][key][stat] for r in runs]

        for ax, key in ((axes[0], "ttft_ms"), (axes[1], "tpot_ms")):
            ax.plot(x, col(key, "median"), marker="o", color=color, label=f"{label} p50")
            if "p99" in runs[0]["summary"][key]:
                ax.plot(x, col(key, "p99"), marker="x", ls="--", color=color, label=f"{label} p99")
        goodput = [r["summary"].get("goodput") for r in runs]
        if all(g is not None for g in goodput):
            slo = " ".join(f"{k}<={v:g}ms" for k, v in runs[0]["summary"]["slo_ms"].items())
            axes[2].plot(x, goodput, marker="o", color=color, label=f"{label} goodput [{slo}]")
        axes[2].plot(x, [r["summary"]["request_throughput"] for r in runs], marker=".", ls=":",
                     color=color, label=f"{label} throughput")
    for ax, ylabel, title in ((axes[0], "TTFT (ms)", "TTFT vs rate"), (axes[1], "TPOT (ms)", "TPOT vs rate"),
                              (axes[2], "requests/s", "goodput vs rate")):
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Lay out `fig`, write it to `path` (creating its folder), close it; returns the
    path. Mutates the file system and closes `fig`."""
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def plot(docs: list[tuple[str, dict[str, Any]]], output: str, title: str | None = None) -> Path:
    """Draw the figure for the loaded results and save it to `output`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = any(sum(np.isfinite(_rate(r)) for r in doc["runs"]) > 1 for _, doc in docs)
    rows = 2 if sweep else 1
    fig, axes = plt.subplots(rows, 3, figsize=(16, 4.5 * rows), squeeze=False)
    _plot_cdfs(list(axes[0]), docs)
    if sweep:
        _plot_sweeps(list(axes[1]), docs)
    if title:
        fig.suptitle(title)
    return save_figure(fig, output)


def main(args: argparse.Namespace) -> int:
    """Entry point of `duet bench plot`."""
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        docs = load_results(args.results, labels)
    except (OSError, ValueError) as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {plot(docs, args.output, args.title)}")
    return 0
