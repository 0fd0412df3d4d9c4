"""Peer systems in the benchmarks, each run in a subprocess of the interpreter that has it (usually
its own virtual environment: `--peer-python`) and timed the way we time ourselves.

llama.cpp (`ecoserve bench latency --compare llama-cpp`): the same GGUF file, prompt token ids,
greedy decode and thread count, through llama-cpp-python; with its prompt-lookup decoding for
scripts/bench_spec_decode.py.

vLLM's CPU build (`ecoserve bench throughput --compare vllm`): the same requests (token ids,
output lengths, greedy, ignore_eos), scheduler limits and dtype (the one our run resolved, passed
explicitly so `auto` cannot resolve differently) through its offline `LLM.generate`, with
its engine core in the calling process (so its process CPU time is counted) and its OpenMP threads
bound to the first `num_threads` cores. Under `--quantization w8a8` vLLM reads the same int8 weights
from a compressed-tensors checkpoint written once beside the model (`vllm_w8a8_checkpoint`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

_LLAMA_CPP_SCRIPT = r"""
import json, sys, time
from llama_cpp import Llama, LogitsProcessorList
path, threads, out_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt, lookup = json.loads(sys.argv[4]), int(sys.argv[5])
draft = {}
if lookup:  # its prompt-lookup decoding: up to `lookup` tokens proposed per step
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    draft = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=lookup)}
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=len(prompt) + out_len + 16,
            seed=0, verbose=False, **draft)
eos = llm.token_eos()


def never_eos(ids, scores):  # as ignore_eos: always decode out_len tokens
    scores[eos] = -float("inf")
    return scores


def decode(n):
    # one stamp per sampled token: `generate` yields each token (create_completion's stream yields text chunks,
    # and holds back the tokens of an incomplete UTF-8 character or a possible stop sequence)
    stamps = []
    for _ in llm.generate(prompt, temp=0.0, logits_processor=LogitsProcessorList([never_eos])):
        stamps.append(time.perf_counter())
        if len(stamps) == n:
            return stamps


decode(4)  # warm-up
llm.reset()  # no prompt-prefix reuse from the warm-up
t0, cpu0 = time.perf_counter(), time.process_time()
stamps = decode(out_len)
cpu = time.process_time() - cpu0
print(json.dumps({"ttft_s": stamps[0] - t0, "decode_tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                  "tpot_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1), "e2e_s": stamps[-1] - t0,
                  "cpu_ms_per_token": 1000 * cpu / len(stamps), "tokens": len(stamps)}))
"""


_VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
work = json.load(open(sys.argv[2]))
t0 = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype=work["dtype"], seed=0, max_num_batched_tokens=work["max_num_batched_tokens"],
          max_num_seqs=work["max_num_seqs"], max_model_len=work["max_model_len"])
startup = time.perf_counter() - t0
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work["output_lens"]]
t0, cpu0 = time.perf_counter(), time.process_time()
outs = llm.generate([{"prompt_token_ids": p} for p in work["prompts"]], params, use_tqdm=False)
figures = {"elapsed_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "startup_s": startup,
           "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
if work.get("profile"):  # the same work again (ids shifted: no prefix-cache hits) under torch.profiler
    from torch.profiler import ProfilerActivity, profile
    shifted = [{"prompt_token_ids": [(t + 1) % work["vocab"] for t in p]} for p in work["prompts"]]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(shifted, params, use_tqdm=False)
    figures["op_seconds"] = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
print(json.dumps(figures))
"""


class PeerUnavailable(RuntimeError):
    """The peer could not run (not installed in that interpreter, or it failed): said, never hidden."""


def _run(peer: str, python: str, script: str, argv: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """The JSON line `script` prints last, run by `python`."""
    try:
        out = subprocess.run([python, "-c", script, *argv], capture_output=True, text=True, timeout=timeout_s,
                             env={**os.environ, **(env or {})})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PeerUnavailable(f"{peer} under {python} did not run: {e}") from None
    if out.returncode < 0:  # a crash in native code prints nothing useful to stderr
        raise PeerUnavailable(f"{peer} under {python} was killed by signal {-out.returncode}")
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PeerUnavailable(f"{peer} under {python} failed: {tail}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_decode(python: str, gguf_path: Path, prompt_ids: list[int], output_len: int, num_threads: int,
                     timeout_s: float = 600, prompt_lookup: int = 0) -> dict:
    """llama.cpp's batch-1 greedy decode figures (same keys as ours) on `gguf_path`; `prompt_lookup` > 0: with
    llama-cpp-python's prompt-lookup decoding (`LlamaPromptLookupDecoding`) proposing that many tokens."""
    return _run("llama-cpp-python", python, _LLAMA_CPP_SCRIPT,
                [str(gguf_path), str(num_threads), str(output_len), json.dumps(prompt_ids), str(prompt_lookup)],
                timeout_s)


def vllm_generate(python: str, model_dir: Path, prompts: list[list[int]], output_lens: list[int], num_threads: int,
                  max_num_batched_tokens: int, max_num_seqs: int, dtype: str, timeout_s: float = 1800,
                  profile_vocab: int | None = None) -> dict:
    """vLLM's offline run of the requests in `dtype` (float32, bfloat16): elapsed_s, cpu_s, startup_s and
    output_tokens; with `profile_vocab` (the model's vocabulary size), also op_seconds: the self seconds of each
    op of a second, profiled pass of the same work (token ids shifted by one within the vocabulary)."""
    work = {"prompts": prompts, "output_lens": output_lens, "max_num_batched_tokens": max_num_batched_tokens,
            "max_num_seqs": max_num_seqs, "dtype": dtype, "profile": profile_vocab is not None,
            "vocab": profile_vocab,
            "max_model_len": max(len(p) + n for p, n in zip(prompts, output_lens)) + 16}
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{max(num_threads, 1) - 1}",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(work, f)
        f.flush()
        return _run("vLLM", python, _VLLM_SCRIPT, [str(model_dir), f.name], timeout_s, env)


# the decoder layers' linear weights of the Llama family, as HF names them
_LINEAR_WEIGHT = re.compile(r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# compressed-tensors' description of W8A8 int8 (what llm-compressor writes for a dynamic per-token scheme)
_W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                              "group_size": None, "block_structure": None}}},
}


def vllm_w8a8_checkpoint(model_dir: Path) -> Path:
    """The model as vLLM loads W8A8 int8 (compressed-tensors: int8 weights and one float32 scale per output
    channel; activations rounded per token at run time), its decoder linears rounded by the function
    `--quantization w8a8` uses, so both engines multiply the same integers. The LM head stays float in both:
    this copy's config ignores `lm_head`, and ours keeps it float unless `--quantize-lm-head`. Written once per
    model directory and weights, under the cache root (`vllm-w8a8/`)."""
    from safetensors.torch import load_file, save_file

    from ecoserve.cache_dir import cache_root
    from ecoserve.model.w8a8 import quantize_per_channel

    model_dir = Path(model_dir).resolve()
    shards = sorted(model_dir.glob("*.safetensors"))
    # one copy per model directory and weights (a rewritten checkpoint gets a new one)
    key = hashlib.sha1(json.dumps([str(model_dir)] + [[f.name, f.stat().st_size, f.stat().st_mtime_ns]
                                                      for f in shards]).encode()).hexdigest()[:12]
    dst = cache_root() / "vllm-w8a8" / f"{model_dir.name}-{key}"
    if (dst / "model.safetensors").exists():
        return dst
    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(model_dir, tmp, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    out, quantized = {}, 0
    for shard in shards:
        for name, tensor in load_file(shard).items():
            if _LINEAR_WEIGHT.search(name):
                out[name], scale = quantize_per_channel(tensor)
                out[name.removesuffix("weight") + "weight_scale"] = scale[:, None].contiguous()
                quantized += 1
            else:
                out[name] = tensor.contiguous()
    if not quantized:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PeerUnavailable(f"{model_dir} has no Llama-family decoder linears to write as W8A8 for vLLM")
    save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = _W8A8_CONFIG
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(dst)  # whole or not at all: a killed write leaves only the temporary folder
    return dst
