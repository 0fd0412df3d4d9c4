"""Serving with LoRA adapters, side by side: `ecoserve serve` and `vllm serve` (its CPU build), each with no
LoRA and with 1, 4 and 16 adapters of rank 8 and of rank 64, measured by one client (`ecoserve bench serve`,
whose `--lora-modules` sends each request to one of the adapters at random, as `vllm bench serve`'s does).

    python scripts/bench_lora_serve.py --peer-python $VLLM_PY --out results/lora_serve

Per system: one server without LoRA (the base model), then one per rank with `--enable-lora --max-loras 16
--max-lora-rank R --max-cpu-loras 16` and 16 random adapters on every projection (q, k, v, o, gate, up,
down), each adapter warmed by one request before the timed runs. Servers get the same cores
(`--server-cores`), the client the others, the same model (the embedded SmolLM2's HF conversion), dtype and
scheduler limits, and the same requests (random dataset, fixed seed, EOS ignored). Prints one table with
each configuration's mean TPOT relative to the same system without LoRA and writes `lora_serve.json`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

from bench_serve_peers import NAME, run_client, serving
from bench_serve_peers import server_command as peer_server_command

from ecoserve.bench.adapters import ALL_PROJECTIONS, random_lora_adapter
from ecoserve.model.default import default_model_dir

RANKS = (8, 64)
COUNTS = (1, 4, 16)


def adapters_for(model_dir: str, root: Path, rank: int, count: int) -> dict[str, str]:
    """`count` random adapters of `rank` (written once, reused by every system)."""
    out = {}
    for k in range(count):
        path = root / f"r{rank}-{k}"
        if not (path / "adapter_model.safetensors").exists():
            random_lora_adapter(model_dir, path, rank, seed=1000 * rank + k, targets=ALL_PROJECTIONS, scale=0.05)
        out[f"r{rank}-{k}"] = str(path)
    return out


def server_command(system: str, args: argparse.Namespace, port: int, rank: int | None,
                   adapters: dict[str, str]) -> tuple[list[str], dict]:
    lora = [] if rank is None else ["--enable-lora", "--max-loras", str(max(COUNTS)), "--max-lora-rank", str(rank),
                                    "--max-cpu-loras", str(max(COUNTS)), "--lora-modules",
                                    *(f"{name}={path}" for name, path in adapters.items())]
    return peer_server_command(system, args, port, lora)


def warm_adapter(port: int, name: str) -> None:
    body = json.dumps({"model": name, "prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def client_command(args: argparse.Namespace, port: int, out: Path, name: str, loras: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "ecoserve", "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--model", NAME, "--tokenizer", args.model_dir,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "0", "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.request_rate), "--seed", "0", "--ignore-eos", "--temperature", "0",
           "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm"]
    return cmd + (["--lora-modules", *loras] if loras else [])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-python", default=None, help="the interpreter of vLLM's own virtual environment")
    p.add_argument("--systems", default="ecoserve,vllm")
    p.add_argument("--model-dir", default=None, help="HF model directory (default: the embedded SmolLM2)")
    p.add_argument("--server-cores", default="0")
    p.add_argument("--client-cores", default="1")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--port", type=int, default=18800)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--client-timeout", type=float, default=900)
    p.add_argument("--out", default="results/lora_serve")
    args = p.parse_args(argv)
    args.model_dir = args.model_dir or str(default_model_dir())
    if "vllm" in args.systems.split(",") and not args.peer_python:
        p.error("--peer-python is needed for the vllm system")
    return args


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    adapters = {rank: adapters_for(args.model_dir, out / "adapters", rank, max(COUNTS)) for rank in RANKS}
    rows, port = [], args.port
    for system in args.systems.split(","):
        for rank in (None, *RANKS):
            port += 1
            served = adapters[rank] if rank is not None else {}
            cmd, env = server_command(system, args, port, rank, served)
            label = f"{system}-{'base' if rank is None else f'r{rank}'}"
            try:
                with serving(cmd, env, port, args.server_cores, out / f"server-{label}.log",
                             args.ready_timeout) as startup:
                    for name in served:
                        warm_adapter(port, name)
                    print(f"{label}: ready in {startup:.1f} s", flush=True)
                    for count in (COUNTS if rank is not None else (0,)):
                        loras = list(served)[:count]
                        name = f"{label}-{count}.json"
                        run_client(client_command(args, port, out, name, loras), args.client_cores,
                                   args.client_timeout)
                        r = json.loads((out / name).read_text())
                        rows.append({"system": system, "rank": rank, "adapters": count, "completed": r["completed"],
                                     "output_throughput": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
                                     "mean_tpot_ms": r["mean_tpot_ms"], "p99_tpot_ms": r.get("p99_tpot_ms"),
                                     "startup_s": startup})
                        print(json.dumps(rows[-1]), flush=True)
            except (SystemExit, subprocess.SubprocessError, OSError) as e:  # one system failing is a finding
                print(f"{label}: failed: {e} (see {out}/server-{label}.log)", flush=True)
                rows.append({"system": system, "rank": rank, "adapters": None, "error": str(e)})
    base = {r["system"]: r["mean_tpot_ms"] for r in rows if r.get("rank") is None and "mean_tpot_ms" in r}
    print(f"\n{args.num_prompts} requests of {args.input_len} in / {args.output_len} out at {args.request_rate} req/s, "
          f"{args.dtype}, greedy; servers on cores {args.server_cores}, the client on {args.client_cores}")
    print(f"{'system':<10}{'rank':>5}{'adapters':>9}{'done':>5}{'out tok/s':>11}{'TTFT ms':>9}{'TPOT ms':>9}"
          f"{'P99 TPOT':>9}{'TPOT / base':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['system']:<10}{str(r['rank'] or '-'):>5}   failed: {r['error']}")
            continue
        ratio = r["mean_tpot_ms"] / base[r["system"]] if base.get(r["system"]) else float("nan")
        print(f"{r['system']:<10}{str(r['rank'] or '-'):>5}{r['adapters']:>9}{r['completed']:>5}"
              f"{r['output_throughput']:>11.1f}{r['mean_ttft_ms']:>9.0f}{r['mean_tpot_ms']:>9.1f}"
              f"{(r['p99_tpot_ms'] or 0):>9.1f}{ratio:>12.2f}")
    (out / "lora_serve.json").write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print(f"wrote {out / 'lora_serve.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
