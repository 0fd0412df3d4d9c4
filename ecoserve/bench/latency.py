"""`ecoserve bench latency`: process start-up to ready, and batch-1 decode speed."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

from ecoserve.config import QUANTIZATIONS, EngineArgs

_READY_SCRIPT = """
import argparse, dataclasses, sys, time
t0 = float(sys.argv[1])
from ecoserve.config import EngineArgs
from ecoserve.engine.llm import LLM
parser = argparse.ArgumentParser()
EngineArgs.add_cli_args(parser)
LLM(**dataclasses.asdict(EngineArgs.from_cli_args(parser.parse_args(sys.argv[2:]))))
print(time.time() - t0)
"""


def measure_startup(engine: EngineArgs) -> float:
    """Seconds from launching a fresh Python process to an engine ready to serve (imports included)."""
    out = subprocess.run([sys.executable, "-c", _READY_SCRIPT, repr(time.time()), *engine.to_cli_args()],
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def prompt_token_ids(prompt_len: int) -> list[int]:
    """The benchmark's prompt: fixed ordinary token ids, the same for every system."""
    return [100 + i % 1000 for i in range(prompt_len)]


def measure_decode(engine: EngineArgs, prompt_len: int, output_len: int, profile: bool = False) -> dict:
    """Batch-1 greedy decode: wall-clock figures, and process CPU time per output token (robust to a
    shared machine, where wall time includes waiting for a core)."""
    from ecoserve.engine.llm import LLM
    from ecoserve.sampling import SamplingParams

    llm = LLM(**dataclasses.asdict(engine))
    prompt = {"prompt_token_ids": prompt_token_ids(prompt_len)}
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    figures = decode_figures(out, time.perf_counter() - t0, time.process_time() - cpu0)
    if profile:
        from ecoserve.bench.profile import report

        figures["profile"] = report(lambda: llm.generate([prompt], params, use_tqdm=False), output_len, "token")
    return figures


def decode_figures(out, elapsed_s: float, cpu_s: float) -> dict:
    """One request's batch-1 figures from its output's timestamps (decode: first token to last)."""
    m, n = out.metrics, len(out.outputs[0].token_ids)
    decode_s = m.last_token_time - m.first_token_time
    return {"ttft_s": m.first_token_time - m.arrival_time, "decode_tokens_per_s": (n - 1) / decode_s,
            "e2e_s": elapsed_s, "tpot_ms": 1000 * decode_s / (n - 1), "cpu_ms_per_token": 1000 * cpu_s / n}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="start-up time and batch-1 decode speed")
    EngineArgs.add_cli_args(p, skip=("quantization",))
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--quantization", dest="quantizations", nargs="+", default=["none"], choices=QUANTIZATIONS,
                   help="one run per value, side by side (e.g. --quantization none gguf)")
    p.add_argument("--dtypes", nargs="+", default=None, metavar="DTYPE",
                   help="one float-weight run per dtype, side by side (e.g. --dtypes bfloat16 float32); "
                        "quantized runs keep --dtype")
    p.add_argument("--compare", choices=["llama-cpp"], default=None,
                   help="also run llama.cpp (llama-cpp-python) on the same GGUF file, prompt and threads")
    p.add_argument("--peer-python", default=sys.executable,
                   help="the interpreter that has llama-cpp-python (e.g. its own venv's bin/python)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the systems in turn")
    p.add_argument("--profile", action="store_true", help="print where the CPU time of a decode goes")
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)


def _print_decode(name: str, figures: dict, prompt_len: int) -> None:
    print(f"{name:<24} TTFT {figures['ttft_s'] * 1000:6.0f} ms ({prompt_len} prompt tokens), decode "
          f"{figures['decode_tokens_per_s']:6.1f} tokens/s (TPOT {figures['tpot_ms']:6.1f} ms, "
          f"{figures['cpu_ms_per_token']:5.1f} ms process CPU per token)")


def main(args: argparse.Namespace) -> int:
    from ecoserve.bench import peers
    from ecoserve.model.loader import gguf_file

    if args.compare == "llama-cpp" and gguf_file(args.model) is None:
        raise SystemExit("--compare llama-cpp needs a .gguf model (or the embedded default)")
    engine = EngineArgs.from_cli_args(args)
    variants = _variants(engine, args.quantizations, args.dtypes)
    runs: list[dict] = []
    for name, variant in variants:
        startup = measure_startup(variant)
        print(f"{name} start-up (process start to ready): {startup:.2f} s")
        runs.append({"system": name, "dtype": variant.dtype, "quantization": variant.quantization or "none",
                     "startup_s": startup})
    for round_ in range(args.repeats):
        for (_, variant), run in zip(variants, runs):
            figures = measure_decode(variant, args.prompt_len, args.output_len, args.profile and round_ == 0)
            run.setdefault("rounds", []).append(figures)
            _print_decode(run["system"], figures, args.prompt_len)
            if "profile" in figures:
                print(figures.pop("profile"))
        if args.compare == "llama-cpp":
            if round_ == 0:
                runs.append({"system": "llama.cpp", "rounds": []})
            try:
                figures = peers.llama_cpp_decode(args.peer_python, gguf_file(args.model),
                                                 prompt_token_ids(args.prompt_len), args.output_len,
                                                 args.num_threads or 1)
            except peers.PeerUnavailable as e:
                raise SystemExit(f"--compare llama-cpp: {e}") from None
            runs[-1]["rounds"].append(figures)
            _print_decode("llama.cpp", figures, args.prompt_len)
    _print_ratios(runs)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model or "SmolLM2-135M-Instruct (embedded)",
                                               "num_threads": args.num_threads, "runs": runs}, indent=2))
    return 0


def _variants(engine: EngineArgs, quantizations: list[str], dtypes: list[str] | None) -> list[tuple[str, EngineArgs]]:
    """The engines to time: float weights at each of `dtypes` (else at --dtype), then each quantization."""
    variants = []
    for quantization in [None if q == "none" else q for q in quantizations]:
        for dtype in (dtypes or [engine.dtype]) if quantization is None else [engine.dtype]:
            variant = dataclasses.replace(engine, quantization=quantization, dtype=dtype)
            variants.append((f"ecoserve-{quantization or _resolved_dtype(variant)}", variant))
    return variants


def _resolved_dtype(engine: EngineArgs) -> str:
    """What `--dtype` resolves to for this model and machine ('auto' depends on both)."""
    from ecoserve.model.loader import load_model_info, resolve_dtype

    if engine.dtype != "auto":
        return engine.dtype
    spec = load_model_info(engine.model, revision=engine.revision, skip_tokenizer_init=True).spec
    return str(resolve_dtype("auto", engine.device, spec.torch_dtype, engine.quantization)).removeprefix("torch.")


def _print_ratios(runs: list[dict]) -> None:
    """Every pair of systems, round by round (a shared machine: only side-by-side ratios mean much)."""
    for i, base in enumerate(runs):
        for other in runs[i + 1:]:
            pairs = list(zip(base["rounds"], other["rounds"]))
            speed = ", ".join(f"x{o['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}" for b, o in pairs)
            cpu = ", ".join(f"x{b['cpu_ms_per_token'] / o['cpu_ms_per_token']:.2f}" for b, o in pairs)
            print(f"{other['system']} / {base['system']}: decode tokens/s {speed}; tokens per CPU second {cpu}")
