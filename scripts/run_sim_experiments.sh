#!/usr/bin/env bash
# Runs every named simulator experiment one after another (one core), writing JSON + PNG to results/sim/
# (progress lines on stdout, e.g. | tee results/sim/experiments.log); then the speed run.
# Usage: scripts/run_sim_experiments.sh [seconds of arrivals per rate point, default 45] [at least this many
#        requests per rate point, default 400]   (docs/reproduction.md's numbers; about 50 min on one core)
set -uo pipefail  # one failing experiment does not stop the others
DUR="${1:-45}"
MIN="${2:-400}"
OUT=results/sim
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
for exp in ${EXPERIMENTS:-overall slo burstiness scaling ablation stepcost windows mitosis}; do
  echo "=== $exp (duration ${DUR}s, >= $MIN requests) $(date +%T)"
  extra=()
  case "$exp" in
    mitosis) extra=() ;;
    windows) ;;
    *) extra=(--num-requests "$MIN") ;;
  esac
  /usr/bin/time -f "$exp: %e s wall, %U s user" ecoserve simulate "$exp" --duration "$DUR" "${extra[@]}" --out "$OUT/$exp"
done
echo "=== speed $(date +%T)"
ecoserve simulate speed --num-requests 100000 --strategies ecoserve,vllm --out "$OUT"
echo "=== done $(date +%T)"
