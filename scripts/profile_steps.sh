#!/usr/bin/env bash
# Profile the engine's prefill, decode and hybrid steps on a GPU and estimate the simulator's
# step-type costs (StepTypeCosts in ecoserve/sim/perf.py): writes results/profile_steps/steps.csv
# and step_costs.json. Prepared for a GPU machine; not yet run on one.
# Usage: scripts/profile_steps.sh MODEL_DIR [device=cuda] [dtype=bfloat16]
# Then: ecoserve simulate stepcost ... with the measured values, or perf_knobs={"step_costs": {...}}.
set -euo pipefail
MODEL="${1:?usage: scripts/profile_steps.sh MODEL_DIR [device] [dtype]}"
DEVICE="${2:-cuda}"
DTYPE="${3:-bfloat16}"
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.device('$DEVICE').type == 'cpu' or torch.cuda.is_available() \
else 'no CUDA device: run this on a GPU machine (or pass cpu as the device)')"
timeout 900 "$PY" scripts/profile_steps.py --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" \
    --out results/profile_steps
