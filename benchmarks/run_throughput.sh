#!/usr/bin/env bash
# The offline throughput runs of docs/performance.md, one after another (never in parallel:
# they would share the 2 cores). Results: out/bench_*.json, logs: out/bench_*.log.
#   nohup benchmarks/run_throughput.sh > out/bench_all.log 2>&1 &
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out}
N=${N:-256}
BS1=${BS1:-8}
mkdir -p "$OUT"
W=(--num-prompts "$N" --input-len 32:512 --output-len 16:256 --seed 0 --num-threads 2)
run() { local name=$1; shift; echo "== $(date +%T) $name: $*"; uptime;
        "$@" > "$OUT/bench_$name.log" 2>&1; echo "== $(date +%T) $name rc=$?"; uptime; }
run duet "$PY" -m duetserve bench throughput "${W[@]}" --dtype float32 \
    --output-json "$OUT/bench_duet.json"
run hf "$PY" benchmarks/hf_static_batch.py "${W[@]}" --batch-sizes 8,32,1 \
    --max-prompts-for-bs1 "$BS1" --duet-json "$OUT/bench_duet.json" \
    --output-json "$OUT/bench_hf.json"
run duet_prefix1000 "$PY" -m duetserve bench throughput "${W[@]}" --prefix-len 1000 \
    --output-json "$OUT/bench_duet_prefix1000.json"
run duet_prefix1000_nocache "$PY" -m duetserve bench throughput "${W[@]}" --prefix-len 1000 \
    --no-prefix-caching --output-json "$OUT/bench_duet_prefix1000_nocache.json"
