"""Per-step cost of constrained decoding: B requests decoding under a JSON schema against
the same B requests unconstrained, at B = 1 and 32 (by default).

    .venv/bin/python -m benchmarks.structured_overhead \\
        [--model M] [--threads 2] [--batches 1,32] [--warmup 8] [--steps 48] \\
        [--repeats 3] [--no-overlap] [--out out/x.json]

For each batch size and repeat, the free (unconstrained, ignore_eos) and the constrained
case run one after the other: B requests are added and prefilled (every request has
sampled its first token), `--warmup` decode steps run untimed, then `--steps` decode
steps are timed one by one. Every figure is the median over the timed steps of all
repeats. The constrained run splits the grammar's share of a step:
  mask fill   llguidance computing the allowed-token bitmasks (all rows, in parallel
              on --threads threads when more than one); on a helper thread started
              before the forward pass, unless --no-overlap
  fill wait   the part of the fill the sampler still waited for after the forward pass
  unpack+mask unpacking the bitmasks and setting disallowed logits to -inf
  accept      advancing each row's grammar state with its sampled token
grammar ms/step = what the step itself pays for the grammar: fill wait (or, with
--no-overlap, the whole fill) + unpack+mask + accept. The overlapped fill still competes
with the forward pass for the cores, which only the step-time difference shows.
Timers wrap the engine's own functions in this process only. The grammar forces long
outputs (an array of 16 objects), so every row decodes for the whole measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from duetserve import LLM, SamplingParams
from duetserve.sampling_params import GuidedDecoding
from duetserve.structured import compiler as grammar_compiler

SCHEMA = {"type": "array", "minItems": 16, "maxItems": 16, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo", "Lima", "Cairo"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.25},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 3}},
    "required": ["name", "age", "city", "score", "tags"]}}
PROMPT = "List sixteen people with their name, age, city, score and tags as JSON."


class Timer:
    """Cumulative wall time of wrapped callables, per label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, timed)


def run_case(llm: LLM, timer: Timer, batch: int, warmup: int, steps: int,
             guided: GuidedDecoding | None) -> dict[str, list[float]]:
    """Per-step figures (ms) of `steps` timed decode steps of `batch` requests."""
    eng = llm.engine
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 64, guided=guided,
                            ignore_eos=guided is None)
    tag = "c" if guided else "f"
    for i in range(batch):
        eng.add_request(f"{tag}{batch}-{i}-{time.time_ns()}", prompt, params)
    while any(not r.output_token_ids for r in eng.scheduler.requests.values()):
        eng.step()                                     # prefills: every row has sampled
    for _ in range(warmup):
        eng.step()
    masker = eng.runner.sampler.masker
    rows_before = masker.num_masked_rows
    out: dict[str, list[float]] = {k: [] for k in ("step", "fill", "wait", "apply",
                                                   "accept")}
    for _ in range(steps):
        before = dict(timer.seconds)
        wait0 = masker.wait_seconds
        t0 = time.perf_counter()
        eng.step()
        out["step"].append(1e3 * (time.perf_counter() - t0))
        for k in ("fill", "apply", "accept"):
            out[k].append(1e3 * (timer.seconds.get(k, 0.0) - before.get(k, 0.0)))
        out["wait"].append(1e3 * (masker.wait_seconds - wait0))
    rows = masker.num_masked_rows - rows_before
    assert guided is None or rows == batch * steps, (rows, batch, steps)  # all rows decoded
    assert len(eng.scheduler.requests) == batch                          # none finished
    eng.abort_request(list(eng.requests))
    return out


def summarize(runs: list[dict[str, list[float]]], overlap: bool) -> dict[str, float]:
    """Medians over all timed steps of all repeats."""
    per_step: dict[str, list[float]] = {}
    for run in runs:
        for i in range(len(run["step"])):
            fill, wait, apply = run["fill"][i], run["wait"][i], run["apply"][i]
            unpack = apply - wait - (0.0 if overlap else fill)     # apply() minus the fill
            values = {"step_ms": run["step"][i], "mask_fill_ms": fill, "fill_wait_ms": wait,
                      "unpack_mask_ms": unpack, "accept_ms": run["accept"][i],
                      "grammar_ms": apply + run["accept"][i]}
            for k, v in values.items():
                per_step.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in per_step.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps per case")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per case")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="out/structured_overhead.json")
    ap.add_argument("--no-overlap", action="store_true",
                    help="fill the masks after the forward pass (not on a helper thread "
                         "during it), to measure what the overlap saves")
    args = ap.parse_args()
    overlap = not args.no_overlap
    llm = LLM(model=args.model, num_threads=args.threads, max_num_batched_tokens=2048,
              kv_cache_memory=1.0, enable_prefix_caching=False)
    eng = llm.engine
    if not overlap:
        eng.runner.sampler.prefetch_masks = lambda states: None
    timer = Timer()
    timer.wrap(eng.grammars, "fill_bitmasks", "fill")
    timer.wrap(eng.runner.sampler.masker, "apply", "apply")
    timer.wrap(grammar_compiler.GrammarState, "accept", "accept")
    guided = GuidedDecoding("json", json.dumps(SCHEMA), "guided_json")
    t0 = time.perf_counter()
    eng.grammars.compile(guided)
    compile_ms = 1e3 * (time.perf_counter() - t0)     # includes the tokenizer trie
    t0 = time.perf_counter()
    eng.grammars.compile(GuidedDecoding("json", json.dumps({**SCHEMA, "minItems": 15})))
    compile2_ms = 1e3 * (time.perf_counter() - t0)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        free_runs, constrained_runs = [], []
        for _ in range(args.repeats):
            free_runs.append(run_case(llm, timer, batch, args.warmup, args.steps, None))
            constrained_runs.append(run_case(llm, timer, batch, args.warmup, args.steps,
                                             guided))
        free = summarize(free_runs, overlap)
        constrained = summarize(constrained_runs, overlap)
        results.append({"batch": batch, "free": free, "constrained": constrained,
                        "raw": {"free": free_runs, "constrained": constrained_runs}})
    print(f"{os.path.basename(eng.loaded.path)}, vocab {eng.model_config.vocab_size}, "
          f"{args.threads} threads, masks filled "
          f"{'during' if overlap else 'after'} the forward pass; medians of "
          f"{args.repeats} x {args.steps} decode steps per case after {args.warmup} warm-up "
          f"steps; first compile {compile_ms:.0f} ms (with the tokenizer trie), next schema "
          f"{compile2_ms:.1f} ms")
    print("| batch | step ms free | step ms constrained | mask fill ms | fill wait ms | "
          "unpack+mask ms | accept ms | grammar ms/step | grammar share of step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        f, c = r["free"], r["constrained"]
        print(f"| {r['batch']} | {f['step_ms']:.1f} | {c['step_ms']:.1f} | "
              f"{c['mask_fill_ms']:.2f} | {c['fill_wait_ms']:.2f} | "
              f"{c['unpack_mask_ms']:.2f} | {c['accept_ms']:.2f} | "
              f"{c['grammar_ms']:.2f} | {100 * c['grammar_ms'] / c['step_ms']:.1f}% |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": eng.loaded.path, "vocab_size": eng.model_config.vocab_size,
                   "threads": args.threads, "warmup": args.warmup, "steps": args.steps,
                   "repeats": args.repeats, "schema": SCHEMA, "overlap": overlap,
                   "compile_ms_first": compile_ms, "compile_ms_next": compile2_ms,
                   "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
