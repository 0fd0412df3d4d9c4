#!/usr/bin/env bash
# Runs every named simulator experiment one after another (one core), writing JSON + PNG to
# results/sim/ (about 29 CPU-minutes in all; progress lines on stdout, e.g. | tee results/sim/experiments.log).
# Usage: scripts/run_sim_experiments.sh [seconds of arrivals per rate point, default 30]
set -uo pipefail  # one failing experiment does not stop the others
DUR="${1:-30}"
OUT=results/sim
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
for exp in ${EXPERIMENTS:-scaling ablation overall slo burstiness mitosis}; do
  echo "=== $exp (duration ${DUR}s) $(date +%T)"
  /usr/bin/time -f "$exp: %e s wall, %U s user" ecoserve simulate "$exp" --duration "$DUR" --out "$OUT"
done
echo "=== speed $(date +%T)"
ecoserve simulate speed --num-requests 100000 --strategies ecoserve,vllm --out "$OUT"
echo "=== done $(date +%T)"
