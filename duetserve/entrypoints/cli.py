"""`duet` command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `main(args) -> int`; modules are imported only when their
subcommand runs, so `duet --help` stays fast and light."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, help). Nested commands use "group sub".
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("duetserve.entrypoints.generate", "generate completions (greedy by default)"),
    "chat": ("duetserve.entrypoints.chat", "interactive chat with streaming output"),
    "serve": ("duetserve.entrypoints.openai.serve", "OpenAI-compatible HTTP server"),
    "router": ("duetserve.entrypoints.router.app",
               "OpenAI API in front of prefill and decode instances (disaggregation)"),
    "cluster": ("duetserve.cluster.cli",
                "instances as Ray actors across nodes, with the router in front (scale-out)"),
    "roofline": ("duetserve.metrics.roofline", "roofline analysis of a model on hardware"),
    "plot": ("duetserve.metrics.plot_trace", "plot a step trace written by --trace-file"),
    "bench throughput": ("duetserve.bench.throughput", "offline throughput benchmark"),
    "bench serve": ("duetserve.bench.serve", "HTTP serving benchmark against any OpenAI server"),
    "bench plot": ("duetserve.bench.plot", "plot results of duet bench serve"),
    "simulate": ("duetserve.entrypoints.simulate",
                 "simulate serving: the real scheduler timed by the step-time model"),
    "plan": ("duetserve.entrypoints.plan",
             "plan a deployment: colocated vs disaggregated goodput per GPU under SLOs"),
}


class UserError(Exception):
    """An error the user can fix; printed as one line, exit code 2."""


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duet", description="duetserve: prefill/decode-aware LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    wanted = argv[:2]
    for name, (module, help_text) in COMMANDS.items():
        parts = name.split()
        if len(parts) == 2:
            if parts[0] not in groups:
                gp = sub.add_parser(parts[0], help=f"{parts[0]} commands")
                groups[parts[0]] = gp.add_subparsers(dest="subcommand", required=True)
            p = groups[parts[0]].add_parser(parts[1], help=help_text)
        else:
            p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        # Only import the module whose subcommand is being run (for its arguments).
        if parts == wanted[: len(parts)]:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module = importlib.import_module(args._module)
    try:
        return int(module.main(args) or 0)
    except UserError as e:
        print(f"duet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
