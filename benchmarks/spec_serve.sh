#!/bin/bash
# Serving with and without adaptive n-gram speculation (issue 13): `duet bench serve` on
# editing prompts (benchmarks/spec_decode.py's EDIT_PROMPTS, repeated), at 1, 4 and 32
# concurrent requests. Both servers (off, n-gram) stay up side by side (only the one being
# measured works) and the runs alternate between them, REPEATS times per concurrency (the
# order flips each repeat), so a machine that speeds up or slows down during the script
# moves both alike. Prints medians and their ratio, writes JSON.
#   benchmarks/spec_serve.sh OUTDIR [MODEL]      (default model: SmolLM2-135M; REPEATS=3;
#                                                CONCS="1 4 32": the concurrencies run;
#                                                NREQ: requests a run, default 8 (64 at 32))
set -e
OUT=${1:-out/spec_serve}; MODEL=${2:-}; REPEATS=${REPEATS:-3}; CONCS=${CONCS:-1 4 32}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
$PY - "$OUT/edit.jsonl" <<'PYEOF'
import json, sys
sys.path.insert(0, "benchmarks")
from spec_decode import EDIT_PROMPTS
with open(sys.argv[1], "w") as f:
    for conv in EDIT_PROMPTS * 16:
        f.write(json.dumps({"prompt": conv[0]["content"], "output_len": 128}) + "\n")
PYEOF
declare -A PORT=([off]=18613 [ngram]=18614)
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait 2>/dev/null' EXIT
for cfg in off ngram; do
  SPEC=()
  [ "$cfg" = ngram ] && SPEC=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}')
  # one after the other: two start-ups measuring kernels at once would spoil both
  $PY -m duetserve serve ${MODEL:+--model "$MODEL"} --num-threads 2 --port ${PORT[$cfg]} \
      "${SPEC[@]}" > "$OUT/server-$cfg.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 180); do curl -sf http://127.0.0.1:${PORT[$cfg]}/v1/models >/dev/null && break; sleep 1; done
done
for conc in $CONCS; do
  n=${NREQ:-$(( conc == 32 ? 64 : 8 ))}
  for r in $(seq $REPEATS); do
    order="off ngram"; [ $((r % 2)) = 0 ] && order="ngram off"
    for cfg in $order; do
      $PY -m duetserve bench serve --base-url http://127.0.0.1:${PORT[$cfg]} --endpoint chat \
          --dataset jsonl --dataset-path "$OUT/edit.jsonl" --num-prompts $n \
          --request-rate inf --max-concurrency $conc --temperature 0 --no-progress \
          --output-json "$OUT/$cfg-c$conc-r$r.json" > "$OUT/$cfg-c$conc-r$r.txt" 2>&1
    done
  done
done
$PY - "$OUT" "$REPEATS" $CONCS <<'PYEOF'
import json, statistics, sys
out, repeats, concs = sys.argv[1], int(sys.argv[2]), [int(c) for c in sys.argv[3:]]
rows = {}
print(f"{'concurrency':>11} {'config':>6} {'out tok/s':>10} {'TPOT p50 ms':>12} {'ratio':>6}"
      f"  (medians of {repeats}; per-run out tok/s)")
for conc in concs:
    base = None
    for cfg in ("off", "ngram"):
        runs = [json.load(open(f"{out}/{cfg}-c{conc}-r{r}.json"))["runs"][0]["summary"]
                for r in range(1, repeats + 1)]
        thr = statistics.median(s["output_throughput"] for s in runs)
        tpot = statistics.median(s["tpot_ms"]["median"] for s in runs)
        base = base or thr
        rows[f"{cfg}-c{conc}"] = {"output_throughput": thr, "tpot_p50_ms": tpot,
                                  "runs_output_throughput": [s["output_throughput"] for s in runs],
                                  "runs_tpot_p50_ms": [s["tpot_ms"]["median"] for s in runs]}
        per = " ".join(f"{s['output_throughput']:.0f}" for s in runs)
        print(f"{conc:>11} {cfg:>6} {thr:10.1f} {tpot:12.1f} {thr / base:6.2f}  ({per})")
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
PYEOF
