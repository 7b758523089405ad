#!/usr/bin/env bash
# The peer comparison of docs/performance.md: duetserve vs llama.cpp (Q4_1 and F32) vs
# transformers static batching, same seeded workload, servers run one after another.
#   nohup benchmarks/peers/run_peers.sh > out/peers/run_peers.log 2>&1 &
# Environment: N (prompts per rate), RATES, ENGINES, OUTDIR, LLAMA_SERVER_BIN (optional
# native llama-server with parallel slots), NICE (e.g. 19 for a smoke test), EXTRA (more flags).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
N=${N:-64}
RATES=${RATES:-0.5,2,inf}
ENGINES=${ENGINES:-duet,llamacpp-q4_1,duet-f32,llamacpp-f32}
# native llama-server (parallel slots), built once from source (build_llama_cpp.sh)
LLAMA_SERVER_BIN=${LLAMA_SERVER_BIN:-$(benchmarks/peers/build_llama_cpp.sh)/llama-server}
OUTDIR=${OUTDIR:-out/peers/run}
mkdir -p "$OUTDIR"
args=(--engines "$ENGINES" --rates "$RATES" --num-prompts "$N"
      --input-len 32:256 --output-len 32:128 --seed 0 --threads 2
      --out-dir "$OUTDIR" --output-json "$OUTDIR/compare.json"
      --plot-cdf "${PLOT_CDF:-docs/peers_cdf.png}" --plot-curve "${PLOT_CURVE:-docs/peers_rates.png}")
[ -n "${LLAMA_SERVER_BIN:-}" ] && args+=(--llama-server-bin "$LLAMA_SERVER_BIN")
[ -n "${NICE:-}" ] && args+=(--nice "$NICE")
echo "== $(date +%T) start"; uptime
"$PY" benchmarks/peers/compare.py "${args[@]}" ${EXTRA:-}
echo "== $(date +%T) done"; uptime
