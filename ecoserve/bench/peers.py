"""Peer systems in the benchmarks, each run in a subprocess of the interpreter that has it (usually
its own virtual environment: `--peer-python`) and timed the way we time ourselves.

llama.cpp (`ecoserve bench latency --compare llama-cpp`): the same GGUF file, prompt token ids,
greedy decode and thread count, through llama-cpp-python.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

_LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, out_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + out_len + 16,
            seed=0, verbose=False)
never_eos = {llm.token_eos(): -1e9}  # as ignore_eos: always decode out_len tokens
list(llm.create_completion(prompt, max_tokens=4, temperature=0.0, logit_bias=never_eos, stream=True))  # warm-up
llm.reset()  # no prompt-prefix reuse from the warm-up
t0, cpu0 = time.perf_counter(), time.process_time()
stamps = [time.perf_counter() for _ in llm.create_completion(prompt, max_tokens=out_len, temperature=0.0,
                                                            logit_bias=never_eos, stream=True)]
cpu = time.process_time() - cpu0
print(json.dumps({"ttft_s": stamps[0] - t0, "decode_tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                  "tpot_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1), "e2e_s": stamps[-1] - t0,
                  "cpu_ms_per_token": 1000 * cpu / len(stamps), "tokens": len(stamps)}))
"""


class PeerUnavailable(RuntimeError):
    """The peer could not run (not installed in that interpreter, or it failed): said, never hidden."""


def _run(peer: str, python: str, script: str, argv: list[str], timeout_s: float) -> dict:
    """The JSON line `script` prints last, run by `python`."""
    try:
        out = subprocess.run([python, "-c", script, *argv], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerUnavailable(f"{peer} under {python} did not run: {e}") from None
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PeerUnavailable(f"{peer} under {python} failed: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_decode(python: str, gguf_path: Path, prompt_ids: list[int], output_len: int, num_threads: int,
                     timeout_s: float = 600) -> dict:
    """llama.cpp's batch-1 greedy decode figures (same keys as ours) on `gguf_path`."""
    return _run("llama-cpp-python", python, _LLAMA_CPP_SCRIPT,
                [str(gguf_path), str(num_threads), str(output_len), json.dumps(prompt_ids)], timeout_s)
