#!/bin/bash
# Serving with and without adaptive n-gram speculation (issue 13): `duet bench serve` on
# editing prompts (benchmarks/spec_decode.py's EDIT_PROMPTS, repeated), at 1, 4 and 32
# concurrent requests, against one server per configuration. Prints a table, writes JSON.
#   benchmarks/spec_serve.sh OUTDIR [MODEL]      (default model: SmolLM2-135M)
set -e
OUT=${1:-out/spec_serve}; MODEL=${2:-}
mkdir -p "$OUT"
PY=${PY:-/work/main/.venv/bin/python}
$PY - "$OUT/edit.jsonl" <<'PYEOF'
import json, sys
sys.path.insert(0, "benchmarks")
from spec_decode import EDIT_PROMPTS
with open(sys.argv[1], "w") as f:
    for conv in EDIT_PROMPTS * 16:
        f.write(json.dumps({"prompt": conv[0]["content"], "output_len": 128}) + "\n")
PYEOF
PORT=18613
for cfg in off ngram; do
  SPEC=()
  [ "$cfg" = ngram ] && SPEC=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}')
  $PY -m duetserve serve ${MODEL:+--model "$MODEL"} --num-threads 2 --port $PORT \
      "${SPEC[@]}" > "$OUT/server-$cfg.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 120); do curl -sf http://127.0.0.1:$PORT/v1/models >/dev/null && break; sleep 1; done
  for conc in 1 4 32; do
    n=$(( conc == 32 ? 64 : 8 ))
    $PY -m duetserve bench serve --base-url http://127.0.0.1:$PORT --endpoint chat \
        --dataset jsonl --dataset-path "$OUT/edit.jsonl" --num-prompts $n \
        --request-rate inf --max-concurrency $conc --temperature 0 --no-progress \
        --output-json "$OUT/$cfg-c$conc.json" > "$OUT/$cfg-c$conc.txt" 2>&1
  done
  kill $SERVER; wait $SERVER 2>/dev/null || true
done
$PY - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
rows = {}
print(f"{'concurrency':>11} {'config':>6} {'out tok/s':>10} {'TPOT p50 ms':>12} {'ratio':>6}")
for conc in (1, 4, 32):
    base = None
    for cfg in ("off", "ngram"):
        s = json.load(open(f"{out}/{cfg}-c{conc}.json"))
        s = s["runs"][0]["summary"]
        thr, tpot = s["output_throughput"], s["tpot_ms"]["median"]
        base = base or thr
        rows[f"{cfg}-c{conc}"] = {"output_throughput": thr, "tpot_p50_ms": tpot}
        print(f"{conc:>11} {cfg:>6} {thr:10.1f} {tpot:12.1f} {thr / base:6.2f}")
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
PYEOF
