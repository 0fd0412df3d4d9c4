#!/usr/bin/env bash
# CUDA/NCCL check of the parallel engine: a step profile of our engine (prefill, decode and hybrid
# steps by tokens), MoE expert offload, TP/PP correctness tests on the GPU, then the simulator experiment.
# Usage: scripts/device_check.sh [OUT_DIR] [DEVICE=cuda]
#   DEVICE=cpu runs only the step profile and the expert-pool check (tiny models), to check the script path
#   without a GPU.
set -euo pipefail
OUT=${1:-${OUT:-results/device_check}}
DEVICE=${2:-cuda}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# Step profile: a random-weight Llama built here (no downloads), timed by scripts/profile_steps.py.
# On CUDA a ~90M-parameter model (8 layers, hidden 1024) so kernels are not all launch overhead;
# on CPU the tests' tiny model. Prints steps.csv and step_costs.json (StepTypeCosts estimates).
steps_out="$OUT/profile_steps"
model_dir="$OUT/step_model"
timeout 120 "$PY" - "$model_dir" "$DEVICE" <<'PY'
import sys
from tests.utils import make_tiny_checkpoint

path, device = sys.argv[1], sys.argv[2]
size = (dict(num_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
        if device != "cpu" else dict(num_layers=2))
print("step model:", make_tiny_checkpoint(path, **size), size)
PY
# On CPU the run checks the path, not timings: few reps, short contexts, no native-kernel build.
if [ "$DEVICE" = cpu ]; then args=(--dtype float32 --reps 1 --context 16); export ECOSERVE_NO_NATIVE=1
else args=(--dtype bfloat16 --reps 9); fi
timeout "${STEP_TIMEOUT:-300}" "$PY" scripts/profile_steps.py --model "$model_dir" --device "$DEVICE" "${args[@]}" \
    --out "$steps_out" 2>&1 | tee "$OUT/profile_steps.txt"
echo "== $steps_out/steps.csv"; cat "$steps_out/steps.csv"
echo "== $steps_out/step_costs.json"; cat "$steps_out/step_costs.json"; echo
rm -rf "$model_dir"
# MoE expert offload (--moe-resident-experts): the expert pool against every expert resident: equal
# outputs, decode and prefill speed, hits/loads/host-computed experts, bytes moved, the measured cost table
if [ "$DEVICE" = cpu ]; then pool_args=(--budgets 0,3 --decode-tokens 8); else pool_args=(); fi
timeout 300 "$PY" scripts/expert_pool_check.py --device "$DEVICE" --out "$OUT" "${pool_args[@]}" 2>&1 \
    | tee "$OUT/expert_pool.txt"
[ "$DEVICE" = cpu ] && exit 0

nvidia-smi -L | tee "$OUT/gpus.txt"
# the CPU (gloo) tests, then TP=2 and PP=2 on cuda (NCCL, picked from the device) against one GPU
timeout 300 "$PY" -m pytest -q tests/distributed tests/model/test_parallel_shards.py 2>&1 | tee "$OUT/tests.txt"
timeout 300 "$PY" - <<'PY' 2>&1 | tee "$OUT/cuda_equality.txt"
import tempfile
from tests.utils import make_tiny_checkpoint, prompts
from ecoserve import LLM, SamplingParams

if __name__ == "__main__":
    path = make_tiny_checkpoint(tempfile.mkdtemp() + "/m", num_layers=4)
    ps = [{"prompt_token_ids": p} for p in prompts(8, max_len=200)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(str(path), device="cuda", dtype="float32").generate(ps, sp, use_tqdm=False)]
    for kw in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        llm = LLM(str(path), device="cuda", dtype="float32", **kw)
        got = [o.outputs[0].token_ids for o in llm.generate(ps, sp, use_tqdm=False)]
        llm.llm_engine.shutdown()
        print(kw, "equal" if got == ref else "DIFFERENT")
PY
timeout 300 "$PY" -m ecoserve.cli simulate tdpipe --out "$OUT" --num-requests 1000 | tee "$OUT/tdpipe.txt"
