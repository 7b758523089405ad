#!/bin/bash
# Serving with LoRA adapters against the base model alone, on one server: 8 random rank-16
# PEFT adapters of every projection (benchmarks/lora_step.py's), `duet bench serve` at
# saturation alternating base and adapter runs (a new seed each pair), output tok/s each.
#   benchmarks/lora_serve.sh MODEL [PAIRS=2] [LORA_DTYPE=int8] [OUT=out/lora_serve]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$1; PAIRS=${2:-2}; DTYPE=${3:-int8}; OUT=${4:-out/lora_serve}; PORT=8123
mkdir -p "$OUT"
PYTHONPATH=. .venv/bin/python - "$MODEL" "$OUT" <<'PY'
import sys
sys.path.insert(0, "benchmarks")
from lora_step import write_adapter
from duetserve.loader import load_model_config
cfg = load_model_config(sys.argv[1])
for i in range(8):
    write_adapter(f"{sys.argv[2]}/a{i}", cfg, 16, i)
PY
MODS=(); NAMES=()
for i in 0 1 2 3 4 5 6 7; do MODS+=("a$i=$OUT/a$i"); NAMES+=("a$i"); done
.venv/bin/duet serve --model "$MODEL" --num-threads 2 --port $PORT --lora-modules "${MODS[@]}" \
    --max-loras 8 --lora-dtype "$DTYPE" > "$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do curl -sf http://127.0.0.1:$PORT/v1/models > /dev/null && break; sleep 1; done
for p in $(seq 1 "$PAIRS"); do
  for mode in base lora; do
    extra=(); [ $mode = lora ] && extra=(--lora-modules "${NAMES[@]}")
    .venv/bin/duet bench serve --base-url http://127.0.0.1:$PORT --num-prompts 32 \
        --input-len 128 --output-len 64 --ignore-eos --request-rate inf --seed $((10 * p + ${#mode})) \
        "${extra[@]}" --output-json "$OUT/${mode}_$p.json" > "$OUT/${mode}_$p.log" 2>&1
    echo "pair $p $mode: $(grep 'Output token throughput' "$OUT/${mode}_$p.log")"
  done
done
