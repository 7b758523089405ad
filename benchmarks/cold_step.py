"""A cold step on an idle engine, with and without the idle malloc_trim.

PYTHONPATH=. .venv/bin/python benchmarks/cold_step.py trim|keep
Runs 40 single requests (40-token prompt, 4 tokens) through one engine (float32, KV
prefaulted, 2 threads), 0.3 s idle between them (an idle spell, as in the served runs),
and prints the first (cold, prefill-only) step's median and p90 and the decode steps'
median; writes out/cold_step-MODE.json. `keep` replaces the engine's release_free_memory with a no-op.
"""
import sys, time, statistics, random
import duetserve.engine.engine_core as ec
from duetserve.engine.llm import LLM
from duetserve.sampling_params import SamplingParams
trim = sys.argv[1] == "trim"
if not trim:
    ec.release_free_memory = lambda: None
llm = LLM(dtype="float32", kv_prefault=True, num_threads=2)
firsts = []
llm.engine.step_observers.append(lambda s: firsts.append((s.num_prefill_tokens, s.num_decode_tokens, s.step_seconds)))
rng = random.Random(0)
sp = SamplingParams(max_tokens=4, temperature=0.0)
res = []
for i in range(40):
    firsts.clear()
    ids = [rng.randrange(100, 20000) for _ in range(40)]
    llm.engine.add_request(str(i), ids, sp)
    while llm.engine.has_unfinished_requests():
        llm.engine.step_deltas()
    time.sleep(0.3)  # an idle spell between requests, as in the served runs
    if i >= 5:
        res.append((firsts[0][2] * 1e3, statistics.median(f[2] for f in firsts[1:]) * 1e3))
print(sys.argv[1], "cold prefill step ms: median %.1f p90 %.1f; decode steps median %.1f" % (
    statistics.median(r[0] for r in res), sorted(r[0] for r in res)[int(0.9 * len(res))],
    statistics.median(r[1] for r in res)))
import json, os
os.makedirs("out", exist_ok=True)
with open(f"out/cold_step-{sys.argv[1]}.json", "w") as f:
    json.dump({"mode": sys.argv[1], "cold_step_ms": [r[0] for r in res],
               "decode_step_median_ms": [r[1] for r in res]}, f)
