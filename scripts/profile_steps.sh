#!/usr/bin/env bash
# Profile the engine's prefill, decode and hybrid steps and estimate the simulator's step-type costs
# (StepTypeCosts in ecoserve/sim/perf.py): writes OUT/steps.csv (read by StepProfilePerf) and
# OUT/step_costs.json, OUT=results/profile_steps by default.
# Usage: scripts/profile_steps.sh MODEL_DIR|default [device=cuda] [dtype=bfloat16] [extra profile_steps.py args]
#   GPU:  scripts/profile_steps.sh /models/llama-2-13b cuda bfloat16
#   CPU:  scripts/profile_steps.sh default cpu float32   (the embedded SmolLM2, one torch thread, the grid
#         of the live CPU cluster's workload: short prompts, decodes of up to 16 sequences; 3 interleaved passes against CPU noise)
#   CPU bfloat16: scripts/profile_steps.sh default cpu bfloat16   (the same grid in the other precision)
# Then: ClusterSpec(profile="OUT/steps.csv"), or perf_knobs={"step_costs": {...}} from step_costs.json.
# Where the time of a run goes inside its steps (GEMM, attention, elementwise, sampling, Python), per
# precision and against the GEMM peak and memory bandwidth: ecoserve bench throughput --profile --dtypes bfloat16 float32
set -euo pipefail
MODEL="${1:?usage: scripts/profile_steps.sh MODEL_DIR|default [device] [dtype] [args...]}"
DEVICE="${2:-cuda}"
DTYPE="${3:-bfloat16}"
shift $(( $# < 3 ? $# : 3 ))
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-results/profile_steps}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.device('$DEVICE').type == 'cpu' or torch.cuda.is_available() \
else 'no CUDA device: run this on a GPU machine (or pass cpu as the device)')"
GRID=()
if [ "$DEVICE" = cpu ]; then
    GRID=(--num-threads 1 --prefill 8,16,32,64,96,128,192,256,384,512 --decode 1,2,4,8,16
          --context 48,112 --hybrid-prompts 32,128,480 --hybrid-decodes 1,4,16 --reps 3 --passes 3)
fi
timeout 1800 "$PY" scripts/profile_steps.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    --out "$OUT" "${GRID[@]}" "$@"
