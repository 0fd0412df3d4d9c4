#!/usr/bin/env bash
# CUDA/NCCL check of the parallel engine (issue 10): TP/PP correctness tests on the GPU, then the simulator experiment.
# Not run yet: no GPU was lent when it was written. Usage: scripts/device_check.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-${OUT:-results/device_check}}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
nvidia-smi -L | tee "$OUT/gpus.txt"
# same tests as on CPU, with the engine on cuda (NCCL is picked from the device)
ECOSERVE_TEST_DEVICE=cuda timeout 500 "$PY" -m pytest -q tests/distributed tests/model/test_parallel_shards.py \
  2>&1 | tee "$OUT/tests.txt"
timeout 300 "$PY" -m ecoserve.cli simulate tdpipe --out "$OUT" --num-requests 1000 | tee "$OUT/tdpipe.txt"
