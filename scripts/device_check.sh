#!/usr/bin/env bash
# CUDA/NCCL check of the parallel engine: TP/PP correctness tests on the GPU, then the simulator experiment.
# Usage: scripts/device_check.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-${OUT:-results/device_check}}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
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
