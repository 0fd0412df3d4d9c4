#!/usr/bin/env bash
# Runs every named simulator experiment, writing JSON + PNG to results/sim/ (progress lines on stdout,
# e.g. | tee results/sim/experiments.log); then the speed run.
# `overall` (9 cells x 8 curves) runs as two processes, Alpaca | ShareGPT + LongBench, which take about the
# same CPU; the other experiments follow one after another.
# Usage: scripts/run_sim_experiments.sh [seconds of arrivals per rate point, default 45] [at least this many
#        requests per rate point, default 400]   (docs/reproduction.md's numbers)
# EXPERIMENTS="overall" runs only the reproduction table's sweep; GRID_RATIO changes the curves' grid (1.2).
set -uo pipefail  # one failing experiment does not stop the others
DUR="${1:-45}"
MIN="${2:-400}"
OUT=results/sim
GRID=(--grid-ratio "${GRID_RATIO:-1.2}")
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
run() {  # name, then the arguments of `ecoserve simulate`
  local name="$1"; shift
  /usr/bin/time -f "$name: %e s wall, %U s user" ecoserve simulate "$@" --duration "$DUR" "${GRID[@]}"
}
for exp in ${EXPERIMENTS:-overall slo burstiness scaling ablation stepcost windows mitosis}; do
  echo "=== $exp (duration ${DUR}s, >= $MIN requests) $(date +%T)"
  case "$exp" in
    overall)
      run overall_alpaca overall --datasets alpaca --num-requests "$MIN" --out "$OUT/ov_alpaca" \
        > "$OUT/ov_alpaca.log" 2>&1 &
      run overall_sharegpt_longbench overall --datasets sharegpt,longbench --num-requests "$MIN" \
        --out "$OUT/ov_sharegpt_longbench" > "$OUT/ov_sharegpt_longbench.log" 2>&1
      wait
      cat "$OUT/ov_alpaca.log" "$OUT/ov_sharegpt_longbench.log" ;;
    mitosis) run "$exp" "$exp" --out "$OUT/$exp" ;;
    windows) run "$exp" "$exp" --out "$OUT/$exp" ;;
    *) run "$exp" "$exp" --num-requests "$MIN" --out "$OUT/$exp" ;;
  esac
done
echo "=== speed $(date +%T)"
ecoserve simulate speed --num-requests 100000 --strategies ecoserve,vllm --out "$OUT"
echo "=== done $(date +%T)"
