"""`duet chat`: an interactive conversation, tokens streamed as they come.
Empty line or Ctrl-D ends; `/reset` clears the history."""
from __future__ import annotations

import argparse
import itertools
import sys

from duetserve.entrypoints.cli import UserError
from duetserve.entrypoints.engine_args import (add_engine_arguments, build_engine,
                                               stream_to_stdout)
from duetserve.errors import DuetError
from duetserve.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    add_engine_arguments(p)


def main(args: argparse.Namespace) -> int:
    engine = build_engine(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    base = list(history)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    interactive = sys.stdin.isatty()
    for turn in itertools.count():
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        if line.strip() == "/reset":
            history = list(base)
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        try:
            engine.add_request(str(turn), engine.tokenizer.encode_chat(history), params)
        except DuetError as e:
            raise UserError(str(e)) from None
        out = stream_to_stdout(engine)
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": out.outputs[0].text if out else ""})
    return 0
