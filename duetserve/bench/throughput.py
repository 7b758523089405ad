"""`duet bench throughput`: offline throughput of the engine on a fixed set of requests.

Workload (the same one `benchmarks/hf_static_batch.py` runs, through `build_requests`):
  - random: --num-prompts N prompts of random token ids, input and output lengths uniform
    in --input-len / --output-len (MIN:MAX, inclusive), drawn with numpy's seeded generator
    (--seed); token ids avoid every special/added token of the checkpoint's tokenizer.
  - jsonl:  --dataset-path, one {"prompt": str, "output_len": int} per line; prompts are
    encoded with the checkpoint's tokenizer (output_len missing: drawn from --output-len).
  - --prefix-len P puts the same P random tokens in front of every prompt (prefix caching);
    a prompt is then P + its own input length tokens long.
Every request: temperature 0, ignore_eos, max_tokens = its output length.

Timing: a short warm-up (2 requests) runs first and is not counted; then all requests are
queued at once and `LLM.generate` runs them to completion; `elapsed` is its wall time.

Per-phase figures come from the engine's StepStats (one per step):

    step kind      num_prefill_tokens  num_decode_tokens
    prefill-only        > 0                 == 0
    mixed               > 0                 > 0
    decode-only         == 0                > 0

  prefill_tokens_per_s = all prefill tokens / seconds of (prefill-only + mixed) steps
  decode_tokens_per_s  = decode tokens of decode-only steps / seconds of decode-only steps
A mixed step's time is counted once, on the prefill side (it cannot be split), so both
figures are lower bounds of what each phase achieves alone.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duetserve.bench.datasets import DatasetError, parse_len_range, sample_lengths
from duetserve.metrics.step_accounting import format_peaks
from duetserve.outputs import StepStats

DEFAULT_NUM_PROMPTS = 256


@dataclass(slots=True)
class BenchRequest:
    """One request of the benchmark: its prompt as token ids and its output length."""

    prompt_token_ids: list[int]
    output_len: int


# -- workload -------------------------------------------------------------------------------
def load_tokenizer(model: str | None) -> tuple[Any, Any]:
    """(duetserve Tokenizer, ModelConfig) of a checkpoint, without reading the weights."""
    from duetserve.loader import gguf_file, hf_folder, resolve_model_path
    from duetserve.loader.tokenizer import Tokenizer
    path = resolve_model_path(model)
    if hf_folder.is_hf_folder(path):
        cfg = hf_folder.hf_model_config(path)
        return Tokenizer.from_hf_folder(path, cfg), cfg
    reader = gguf_file.open_gguf(path)
    cfg = gguf_file.gguf_model_config(reader, path)
    return Tokenizer.from_gguf(reader, cfg), cfg


def special_token_ids(tokenizer: Any) -> set[int]:
    """Ids a random prompt must not contain: added tokens (special or not), BOS and EOS."""
    ids = set(tokenizer.tok.get_added_tokens_decoder())
    ids.update(tokenizer.eos_token_ids)
    if tokenizer.bos_token_id is not None:
        ids.add(tokenizer.bos_token_id)
    return ids


def random_token_ids(rng: np.random.Generator, n: int, allowed: np.ndarray) -> list[int]:
    """`n` token ids drawn uniformly from `allowed`."""
    return [int(t) for t in allowed[rng.integers(0, len(allowed), size=n)]]


def make_random_requests(num_prompts: int, input_len: tuple[int, int],
                         output_len: tuple[int, int], seed: int, vocab_size: int,
                         excluded_ids: set[int], prefix_len: int = 0) -> list[BenchRequest]:
    """The random workload. Deterministic in (arguments); the order of draws is: input
    lengths, output lengths, shared prefix, then each prompt's own tokens."""
    allowed = np.array([i for i in range(vocab_size) if i not in excluded_ids], dtype=np.int64)
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, input_len, num_prompts)
    out_lens = sample_lengths(rng, output_len, num_prompts)
    prefix = random_token_ids(rng, prefix_len, allowed)
    return [BenchRequest(prefix + random_token_ids(rng, n_in, allowed), n_out)
            for n_in, n_out in zip(in_lens, out_lens)]


def load_jsonl_requests(path: str, tokenizer: Any, num_prompts: int | None,
                        output_len: tuple[int, int], seed: int,
                        prefix_ids: list[int]) -> list[BenchRequest]:
    """Lines {"prompt": str, "output_len": int}; the first `num_prompts` (all if None)."""
    if not os.path.isfile(path):
        raise DatasetError(f"dataset file {path} does not exist")
    rng = np.random.default_rng(seed)
    reqs: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
                n_out = row.get("output_len")
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                raise DatasetError(f"{path}:{lineno}: expected a JSON object with "
                                   '"prompt" (str) and "output_len" (int)') from None
            if n_out is None:
                n_out = sample_lengths(rng, output_len, 1)[0]
            if not isinstance(prompt, str) or not isinstance(n_out, int) or n_out < 1:
                raise DatasetError(f"{path}:{lineno}: prompt must be a string and "
                                   "output_len an integer >= 1")
            reqs.append(BenchRequest(prefix_ids + tokenizer.encode(prompt), n_out))
            if num_prompts is not None and len(reqs) >= num_prompts:
                break
    if not reqs:
        raise DatasetError(f"dataset file {path} has no requests")
    return reqs


def build_requests(args: argparse.Namespace, tokenizer: Any, vocab_size: int
                   ) -> list[BenchRequest]:
    """The workload the flags describe (shared with benchmarks/hf_static_batch.py)."""
    excluded = special_token_ids(tokenizer)
    vocab = min(vocab_size, tokenizer.vocab_size)
    out_range = parse_len_range(args.output_len)
    if args.dataset_path:
        prefix = make_random_requests(1, (1, 1), (1, 1), args.seed, vocab, excluded,
                                      args.prefix_len)[0].prompt_token_ids[:args.prefix_len]
        return load_jsonl_requests(args.dataset_path, tokenizer, args.num_prompts, out_range,
                                   args.seed, prefix)
    return make_random_requests(args.num_prompts or DEFAULT_NUM_PROMPTS,
                                parse_len_range(args.input_len), out_range, args.seed,
                                vocab, excluded, args.prefix_len)


def requests_digest(reqs: list[BenchRequest]) -> str:
    """sha256 of the workload, so two runs can check they ran the same requests."""
    h = hashlib.sha256()
    for r in reqs:
        h.update(json.dumps([r.prompt_token_ids, r.output_len]).encode())
    return h.hexdigest()[:16]


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"number of requests (default {DEFAULT_NUM_PROMPTS}; with "
                        "--dataset-path: every line)")
    g.add_argument("--input-len", default="32:512", help="prompt length N or MIN:MAX tokens")
    g.add_argument("--output-len", default="16:256", help="output length N or MIN:MAX tokens")
    g.add_argument("--prefix-len", type=int, default=0,
                   help="tokens of one shared prefix put in front of every prompt")
    g.add_argument("--dataset-path", default=None,
                   help='JSONL file of {"prompt": str, "output_len": int} lines')


# -- measurement ----------------------------------------------------------------------------
@dataclass
class StepTotals:
    """Sums over the steps of the timed run (a step observer)."""

    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # kind -> [steps, seconds, prefill tokens, decode tokens]
    by_kind: dict[str, list[float]] = field(default_factory=lambda: {
        k: [0, 0.0, 0, 0] for k in ("prefill_only", "mixed", "decode_only")})
    last: StepStats | None = None
    enabled: bool = False

    def __call__(self, st: StepStats) -> None:
        if not self.enabled:
            return
        self.num_steps += 1
        self.prefill_tokens += st.num_prefill_tokens
        self.decode_tokens += st.num_decode_tokens
        kind = {"decode": "decode_only", "prefill": "prefill_only",
                "mixed": "mixed"}[st.phase]      # the scheduler's decision
        row = self.by_kind[kind]
        row[0] += 1
        row[1] += st.step_seconds
        row[2] += st.num_prefill_tokens
        row[3] += st.num_decode_tokens
        self.last = st


def _div(a: float, b: float) -> float:
    return a / b if b else 0.0


def summarize(reqs: list[BenchRequest], outputs: list[Any], elapsed: float,
              totals: StepTotals, base: Any) -> dict[str, Any]:
    """The JSON result; `base` is the StepStats before the timed run (cumulative counters)."""
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    last = totals.last or base
    queries = last.prefix_cache_queries - base.prefix_cache_queries
    hits = last.prefix_cache_hits - base.prefix_cache_hits
    pf = totals.by_kind["prefill_only"]
    mx = totals.by_kind["mixed"]
    dc = totals.by_kind["decode_only"]
    prefill_seconds = pf[1] + mx[1]
    return {
        "num_requests": len(reqs),
        "elapsed_s": elapsed,
        "requests_per_s": _div(len(reqs), elapsed),
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "num_requested_output_tokens": sum(r.output_len for r in reqs),
        "input_tokens_per_s": _div(num_in, elapsed),
        "output_tokens_per_s": _div(num_out, elapsed),
        "total_tokens_per_s": _div(num_in + num_out, elapsed),
        "num_steps": totals.num_steps,
        "mean_prefill_tokens_per_step": _div(totals.prefill_tokens, totals.num_steps),
        "mean_decode_tokens_per_step": _div(totals.decode_tokens, totals.num_steps),
        "num_prefill_tokens": totals.prefill_tokens,
        "num_decode_tokens": totals.decode_tokens,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": _div(hits, queries),
        "num_preemptions": last.num_preemptions - base.num_preemptions,
        "steps": {k: {"num_steps": int(v[0]), "seconds": v[1], "prefill_tokens": int(v[2]),
                      "decode_tokens": int(v[3])} for k, v in totals.by_kind.items()},
        "step_seconds_total": pf[1] + mx[1] + dc[1],
        "prefill_step_seconds": prefill_seconds,
        "decode_only_step_seconds": dc[1],
        "prefill_tokens_per_s": _div(totals.prefill_tokens, prefill_seconds),
        "decode_tokens_per_s": _div(dc[3], dc[1]),
        **_spec_summary(getattr(last, "spec", None), getattr(base, "spec", None)),
        "phase_definition": (
            "prefill_tokens_per_s = all prefill tokens / seconds of steps with prefill "
            "(prefill-only + mixed); decode_tokens_per_s = decode tokens of decode-only "
            "steps / seconds of decode-only steps"),
    }


def _spec_summary(last: Any, base: Any) -> dict[str, Any]:
    """Speculative decoding over the timed run (cumulative SpecDecodeStats at both ends);
    {} when the engine does not speculate."""
    if last is None:
        return {}
    drafts = last.num_drafts - (base.num_drafts if base else 0)
    drafted = last.num_draft_tokens - (base.num_draft_tokens if base else 0)
    accepted = last.num_accepted_tokens - (base.num_accepted_tokens if base else 0)
    return {"spec_num_drafts": drafts, "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": accepted,
            "spec_acceptance_rate": _div(accepted, drafted),
            "spec_mean_accepted_length": 1 + _div(accepted, drafts) if drafts else 0.0}


def format_table(r: dict[str, Any], title: str = "duet bench throughput") -> str:
    rows: list[tuple[str, str]] = [
        ("requests", f"{r['num_requests']}"),
        ("elapsed (s)", f"{r['elapsed_s']:.2f}"),
        ("requests/s", f"{r['requests_per_s']:.3f}"),
        ("input tokens", f"{r['num_input_tokens']}"),
        ("output tokens", f"{r['num_output_tokens']}"),
        ("input tokens/s", f"{r['input_tokens_per_s']:.1f}"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
        ("total tokens/s", f"{r['total_tokens_per_s']:.1f}"),
    ]
    if "num_steps" in r:
        s = r["steps"]
        rows += [
            ("steps", f"{r['num_steps']}  (prefill-only {s['prefill_only']['num_steps']}, "
                      f"mixed {s['mixed']['num_steps']}, "
                      f"decode-only {s['decode_only']['num_steps']})"),
            ("mean prefill tokens/step", f"{r['mean_prefill_tokens_per_step']:.1f}"),
            ("mean decode tokens/step", f"{r['mean_decode_tokens_per_step']:.1f}"),
            ("time in steps with prefill (s)", f"{r['prefill_step_seconds']:.2f}"),
            ("time in decode-only steps (s)", f"{r['decode_only_step_seconds']:.2f}"),
            ("prefill tokens/s (steps w/ prefill)", f"{r['prefill_tokens_per_s']:.1f}"),
            ("decode tokens/s (decode-only steps)", f"{r['decode_tokens_per_s']:.1f}"),
            ("prefix cache hit rate", f"{r['prefix_cache_hit_rate']:.3f}  "
                                      f"({r['prefix_cache_hits']}/{r['prefix_cache_queries']} "
                                      "tokens)"),
            ("preemptions", f"{r['num_preemptions']}"),
        ]
    if "spec_num_drafts" in r:
        rows += [("spec decode: acceptance rate", f"{r['spec_acceptance_rate']:.3f}  "
                  f"({r['spec_num_accepted_tokens']}/{r['spec_num_draft_tokens']} drafts)"),
                 ("spec decode: mean accepted length",
                  f"{r['spec_mean_accepted_length']:.2f}  ({r['spec_num_drafts']} verify "
                  "slices)")]
    u = r.get("utilization")
    if u:
        for phase in ("prefill", "mixed", "decode"):
            if u[phase]["steps"]:
                rows.append((f"{phase} steps: MFU / MBU (time-weighted)",
                             f"{100 * u[phase]['time_weighted_mfu']:.1f}% / "
                             f"{100 * u[phase]['time_weighted_mbu']:.1f}%  "
                             f"({u[phase]['steps']} steps, {u[phase]['seconds']:.1f} s)"))
        rows.append(("roofline of", f"{u['hardware']}: {format_peaks(u['peaks'])} (each "
                                    f"step's compute), {u['mem_bandwidth'] / 1e9:.1f} GB/s"))
    width = max(len(k) for k, _ in rows)
    lines = [f"== {title} ==".center(width + 20)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


# -- command --------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from duetserve.entrypoints.engine_args import add_engine_arguments
    add_engine_arguments(p)
    add_workload_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, help="write the results here")
    g.add_argument("--num-warmup", type=int, default=2,
                   help="short untimed requests before timing (default %(default)s)")
    g.add_argument("--progress", action="store_true", help="show a progress bar (stderr)")


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from duetserve.engine.llm import LLM
    from duetserve.entrypoints.cli import UserError
    from duetserve.entrypoints.engine_args import build_engine
    from duetserve.errors import DuetError
    from duetserve.sampling_params import SamplingParams

    if args.num_threads is None:
        args.num_threads = 2
    if args.prefix_len < 0:
        raise UserError("--prefix-len must be >= 0")
    engine = build_engine(args)
    try:
        reqs = build_requests(args, engine.tokenizer, engine.model_config.vocab_size)
    except DatasetError as e:
        raise UserError(str(e)) from None
    llm = LLM.from_engine(engine)
    totals = StepTotals()
    engine.add_step_observer(totals)

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    try:
        if args.num_warmup > 0:
            warm = make_random_requests(args.num_warmup, (16, 16), (4, 4), args.seed + 12345,
                                        min(engine.model_config.vocab_size,
                                            engine.tokenizer.vocab_size),
                                        special_token_ids(engine.tokenizer))
            llm.generate([w.prompt_token_ids for w in warm], [params(4) for _ in warm])
        base = engine.last_step
        engine.accountant.reset()        # MFU/MBU over the timed run only
        totals.enabled = True
        t0 = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in reqs],
                               [params(r.output_len) for r in reqs],
                               use_tqdm=getattr(args, "progress", False))
        elapsed = time.perf_counter() - t0
    except DuetError as e:
        raise UserError(str(e)) from None
    result = summarize(reqs, outputs, elapsed, totals, base)
    result["utilization"] = engine.accountant.summary()
    cfg = engine.config
    result["workload"] = {
        "dataset_path": args.dataset_path, "input_len": args.input_len,
        "output_len": args.output_len, "prefix_len": args.prefix_len, "seed": args.seed,
        "requests_digest": requests_digest(reqs)}
    result["engine"] = {
        "model": engine.loaded.path, "dtype": cfg.dtype, "num_threads": cfg.num_threads,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size,
        "kv_cache_memory": cfg.kv_cache_memory, "num_blocks": engine.num_blocks,
        "enable_prefix_caching": cfg.enable_prefix_caching}
    result["backend"] = "duetserve"
    return result


def main(args: argparse.Namespace) -> int:
    result = run_benchmark(args)
    print(format_table(result))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.output_json}")
    return 0
