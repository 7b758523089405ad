#!/bin/sh
# duet plan for Llama-3-8B on H100 (989 TFLOP/s bf16, 3.35 TB/s): prefill-heavy and
# decode-heavy workloads, each under a loose and a tight TTFT/TPOT SLO. Simulation only
# (no model runs; the figures do not depend on the machine's load): about 30 minutes for
# the four on a 2-core machine. Output: $OUT/*.{json,png,txt}
#   sh benchmarks/run_sim_plan.sh
set -e
PY=${PY:-.venv/bin/python}
OUT=${OUT:-out/sim/plan}
mkdir -p "$OUT"
run() {  # name workload ttft tpot
    $PY -m duetserve plan --model llama-3-8b --hardware h100-sxm --workload "$2" \
        --slo ttft="$3" tpot="$4" --attainment 90 --num-prompts 600 --max-gpus 4 \
        --colocated-instances 1,2,4 --chunks 256,512,2048,8192 --router least_loaded \
        --link nvlink --no-progress --output-json "$OUT/$1.json" --plot "$OUT/$1.png" \
        | tee "$OUT/$1.txt"
}
run prefill-heavy-loose prefill-heavy 400 40
run prefill-heavy-tight prefill-heavy 150 15
run decode-heavy-loose decode-heavy 400 40
run decode-heavy-tight decode-heavy 150 15
