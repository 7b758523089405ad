#!/usr/bin/env bash
# The CPU figures of docs/performance.md, one after another (never two at once on a small
# machine): step profile, linear kernels, batch-1 decode and prefill against llama.cpp
# (and transformers) on the default model, its F32 copy and, when QWEN names a
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF file, on that; memory; accuracy.
#   QWEN=path/to/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf benchmarks/run_cpu_speed.sh
# Output: out/bench/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
mkdir -p out/bench
LLAMA=$(benchmarks/peers/build_llama_cpp.sh)
SMOL=$($PY -c "from duetserve.loader import default_model_path as p; print(p())")
F32=out/peers/SmolLM2-135M-Instruct.F32.gguf
[ -f "$F32" ] || $PY benchmarks/peers/make_f32_gguf.py --input "$SMOL" --output "$F32"
QWEN=${QWEN:-}
echo "== $(date +%T) profile"; $PY benchmarks/profile_step.py --out out/bench/profile.json
echo "== $(date +%T) linear kernels"; $PY benchmarks/linear_kernels.py --out out/bench/linear.json
echo "== $(date +%T) smol q4_1"; $PY benchmarks/cpu_speed.py --model "$SMOL" --llama-bin "$LLAMA" --transformers --out out/bench/smol_q41.json
echo "== $(date +%T) smol f32"; $PY benchmarks/cpu_speed.py --model "$F32" --llama-bin "$LLAMA" --out out/bench/smol_f32.json
echo "== $(date +%T) accuracy smol"; $PY benchmarks/quant_accuracy.py --out out/bench/acc_smol.json
if [ -n "$QWEN" ]; then
  echo "== $(date +%T) qwen 1.5b"; $PY benchmarks/cpu_speed.py --model "$QWEN" --llama-bin "$LLAMA" --gen-len 64 --out out/bench/qwen15.json
  echo "== $(date +%T) qwen memory"; $PY benchmarks/serve_memory.py --model "$QWEN" | tee out/bench/qwen15_memory.json
  echo "== $(date +%T) accuracy qwen"; $PY benchmarks/quant_accuracy.py --model "$QWEN" --positions 16 --out out/bench/acc_qwen.json
fi
echo "== $(date +%T) done"
