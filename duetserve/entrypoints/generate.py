"""`duet generate`: one prompt streamed to stdout, or a JSONL file of prompts in bulk.

    duet generate --prompt "The sky is" --max-tokens 64
    duet generate --input prompts.jsonl --output out.jsonl     (lines: {"prompt": ...})
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from duetserve.entrypoints.cli import UserError
from duetserve.entrypoints.engine_args import (add_engine_arguments, build_engine,
                                               stream_to_stdout)
from duetserve.errors import DuetError
from duetserve.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--input", help="JSONL file: one {\"prompt\": ..., \"max_tokens\"?: N} "
                     "per line")
    p.add_argument("--output", help="JSONL results (with --input; default stdout)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument("--ignore-eos", action="store_true")
    add_engine_arguments(p)


def _params(args, max_tokens: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=max_tokens or args.max_tokens,
                              ignore_eos=args.ignore_eos, seed=args.seed)
    except ValueError as e:
        raise UserError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    rows = _read_rows(args.input) if args.input else None    # bad input before the load
    engine = build_engine(args)
    try:     # shutdown flushes and closes --trace-file's trace
        return _bulk(args, rows, engine) if rows is not None else _one(args, engine)
    finally:
        engine.shutdown()


def _one(args: argparse.Namespace, engine) -> int:
    prompt = args.prompt if args.prompt is not None else "The three primary colors are"
    tok = engine.tokenizer
    ids = (tok.encode_chat([{"role": "user", "content": prompt}]) if args.chat
           else tok.encode(prompt))
    try:
        engine.add_request("0", ids, _params(args), prompt=prompt)
    except DuetError as e:
        raise UserError(str(e)) from None
    if not args.chat:
        sys.stdout.write(prompt)
    t0 = time.perf_counter()
    out = stream_to_stdout(engine)
    elapsed = time.perf_counter() - t0
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    decode_s = (m.last_token_time - m.first_token_time) if n > 1 else 0.0
    print(file=sys.stdout)
    print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s overall; "
          f"TTFT {m.ttft * 1e3:.0f} ms ({len(ids)} prompt tokens); decode "
          f"{(n - 1) / decode_s if decode_s else 0:.1f} tok/s; model load "
          f"{engine.loaded.load_seconds:.1f} s; finish: {out.outputs[0].finish_reason}]",
          file=sys.stderr)
    return 0


def _read_rows(path: str) -> list[dict]:
    """The --input file's JSON lines ({"prompt": str, "max_tokens"?}); UserError naming
    the file and line otherwise."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                        raise UserError(f"{path}:{n}: expected {{\"prompt\": str}}")
                    rows.append(row)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    return rows


def _bulk(args: argparse.Namespace, rows: list[dict], engine) -> int:
    from duetserve.engine.llm import LLM
    llm = LLM.from_engine(engine)
    params = [_params(args, r.get("max_tokens")) for r in rows]
    try:
        outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=True)
    except DuetError as e:
        raise UserError(str(e)) from None
    sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    try:
        for row, o in zip(rows, outs):
            c = o.outputs[0]
            sink.write(json.dumps({"prompt": row["prompt"], "text": c.text,
                                   "num_prompt_tokens": len(o.prompt_token_ids),
                                   "num_tokens": len(c.token_ids),
                                   "finish_reason": c.finish_reason}) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    return 0
