"""Per-step cost of constrained decoding: B requests decoding under a JSON schema against
the same B requests unconstrained, at B = 1 and 32 (by default).

    flock -x /tmp/duet-bench.lock .venv/bin/python -m benchmarks.structured_overhead \\
        [--model M] [--threads 2] [--batches 1,32] [--steps 48] [--out out/x.json]

For each batch size, after the prefills (every request has sampled its first token),
`--steps` decode steps are timed. The constrained run splits the grammar's share:
  mask fill   llguidance computing the allowed-token bitmasks (all rows, in parallel
              on --threads threads when more than one), on a helper thread started
              before the forward pass
  fill wait   the part of the fill the sampler still waited for (on the critical path)
  mask apply  unpacking the bitmasks and setting disallowed logits to -inf
  accept      advancing each row's grammar state with its sampled token
grammar ms/step = fill wait + mask apply + accept (what the step itself pays).
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


def run_case(llm: LLM, timer: Timer, batch: int, steps: int, guided: GuidedDecoding | None
             ) -> dict:
    eng = llm.engine
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, guided=guided,
                            ignore_eos=guided is None)
    tag = "c" if guided else "f"
    for i in range(batch):
        eng.add_request(f"{tag}{batch}-{i}-{time.time_ns()}", prompt, params)
    while any(not r.output_token_ids for r in eng.scheduler.requests.values()):
        eng.step()                                     # prefills: every row has sampled
    timer.seconds.clear()
    masker = eng.runner.sampler.masker
    rows_before, wait_before = masker.num_masked_rows, masker.wait_seconds
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
    rows = masker.num_masked_rows - rows_before
    assert guided is None or rows == batch * steps, (rows, batch, steps)  # all rows decoded
    eng.abort_request(list(eng.requests))
    ms = {k: 1e3 * v / steps for k, v in timer.seconds.items()}
    wait = 1e3 * (masker.wait_seconds - wait_before) / steps
    return {"step_ms_median": 1e3 * statistics.median(walls),
            "step_ms_mean": 1e3 * sum(walls) / steps,
            "mask_fill_ms": ms.get("fill", 0.0), "fill_wait_ms": wait,
            "mask_apply_ms": ms.get("apply", 0.0) - wait, "accept_ms": ms.get("accept", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--out", default="out/structured_overhead.json")
    ap.add_argument("--no-overlap", action="store_true",
                    help="fill the masks after the forward pass (not on a helper thread "
                         "during it), to measure what the overlap saves")
    args = ap.parse_args()
    llm = LLM(model=args.model, num_threads=args.threads, max_num_batched_tokens=2048,
              kv_cache_memory=1.0, enable_prefix_caching=False)
    eng = llm.engine
    if args.no_overlap:
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
        free = run_case(llm, timer, batch, args.steps, None)
        constrained = run_case(llm, timer, batch, args.steps, guided)
        grammar_ms = (constrained["fill_wait_ms"] + constrained["mask_apply_ms"]
                      + constrained["accept_ms"])
        results.append({"batch": batch, "free": free, "constrained": constrained,
                        "grammar_ms_per_step": grammar_ms,
                        "grammar_share": grammar_ms / constrained["step_ms_mean"]})
    print(f"{os.path.basename(eng.loaded.path)}, vocab {eng.model_config.vocab_size}, "
          f"{args.threads} threads, masks filled "
          f"{'after' if args.no_overlap else 'during'} the forward pass, "
          f"{args.steps} decode steps per case; first compile "
          f"{compile_ms:.0f} ms (with the tokenizer trie), next schema {compile2_ms:.1f} ms")
    print("| batch | step ms free | step ms constrained | mask fill ms | fill wait ms | "
          "mask apply ms | accept ms | grammar ms/step | share of step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        c = r["constrained"]
        print(f"| {r['batch']} | {r['free']['step_ms_mean']:.1f} | {c['step_ms_mean']:.1f} | "
              f"{c['mask_fill_ms']:.2f} | {c['fill_wait_ms']:.2f} | "
              f"{c['mask_apply_ms']:.2f} | {c['accept_ms']:.2f} | "
              f"{r['grammar_ms_per_step']:.2f} | {100 * r['grammar_share']:.1f}% |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": eng.loaded.path, "vocab_size": eng.model_config.vocab_size,
                   "threads": args.threads, "steps": args.steps, "schema": SCHEMA,
                   "overlap": not args.no_overlap,
                   "compile_ms_first": compile_ms, "compile_ms_next": compile2_ms,
                   "results": results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
