"""Serving side by side: `ecoserve serve` and `vllm serve`, each measured by our `bench serve` and by
`vllm bench serve`, in one run.

    python scripts/bench_serve_peers.py --peer-python $VLLM_PY --out results/serve_peers

Every server gets the same cores (`--server-cores`, default core 0: one engine thread) and every
client the others (default core 1), the same model directory (default: the embedded SmolLM2's HF
conversion), the same dtype (`--dtype`, given to every server: `--dtype bfloat16` runs ours against
`vllm serve --dtype bfloat16`), the same scheduler limits, and the same requests (random dataset,
fixed seed, EOS ignored). Systems: `ecoserve` (engine thread inside the API server process),
`ecoserve-core` (the engine in its own process, a one-instance live cluster: `--strategy vllm
--num-instances 1`) and `vllm` (its API server and engine core processes). Prints one table and
writes `serve_peers.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ecoserve.model.default import default_model_dir

NAME = "smollm2"


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server on port {port} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"server on port {port} not ready after {timeout:.0f} s")


def warm_up(port: int) -> None:
    """One short completion first, as `vllm bench serve` does, so no client times a cold first step."""
    body = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 8}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def pinned(cores: str, cmd: list[str]) -> list[str]:
    """`cmd` run on `cores` through taskset, or as it is where taskset is missing."""
    taskset = shutil.which("taskset")
    return [taskset, "-c", cores, *cmd] if taskset else cmd


@contextlib.contextmanager
def serving(cmd: list[str], env: dict, port: int, cores: str, log_path: Path, ready_timeout: float):
    """A server started on `cores` (output to `log_path`), ready and warmed up; yields its start-up seconds and
    stops it on exit, whatever happened."""
    with open(log_path, "w") as log:
        started = time.time()
        proc = subprocess.Popen(pinned(cores, cmd), env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            wait_ready(port, proc, ready_timeout)
            startup = time.time() - started
            warm_up(port)
            yield startup
        finally:
            stop(proc)


def run_client(cmd: list[str], cores: str, timeout: float) -> None:
    """One benchmark client on `cores`, one thread, within `timeout` seconds."""
    subprocess.run(pinned(cores, cmd), check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"),
                   timeout=timeout)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def server_command(system: str, args: argparse.Namespace, port: int, extra: list[str] = ()) -> tuple[list[str], dict]:
    """The server's command line and environment; `extra`: more flags both servers take (vLLM's names)."""
    limits = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
              "--dtype", args.dtype, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if system == "vllm":
        vllm = str(Path(args.peer_python).with_name("vllm"))
        env.update(VLLM_CPU_OMP_THREADS_BIND=args.server_cores.split(",")[0], VLLM_CPU_KVCACHE_SPACE="4")
        return [vllm, "serve", args.model_dir, "--served-model-name", NAME, "--port", str(port),
                "--enforce-eager", *limits], env
    ecoserve = [sys.executable, "-m", "ecoserve", "serve", "--model", args.model_dir, "--served-model-name", NAME,
                "--port", str(port), "--num-threads", "1", *limits]
    if system == "ecoserve-core":
        ecoserve += ["--strategy", "vllm", "--num-instances", "1"]
    return ecoserve, env


def client_command(client: str, args: argparse.Namespace, port: int, result_dir: Path, name: str) -> list[str]:
    common = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", NAME,
              "--tokenizer", args.model_dir, "--dataset-name", "random", "--random-input-len", str(args.input_len),
              "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
              "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate), "--seed", "0",
              "--ignore-eos", "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
              "--disable-tqdm"]
    if args.temperature is not None:  # unset: each client's default (ours 0, vLLM's none: the model's config)
        common += ["--temperature", str(args.temperature)]
    if client == "vllm-bench":
        return [str(Path(args.peer_python).with_name("vllm")), "bench", "serve", *common]
    return [sys.executable, "-m", "ecoserve", "bench", "serve", *common]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peer-python", required=True, help="the interpreter of vLLM's own virtual environment")
    p.add_argument("--model-dir", default=None, help="HF model directory (default: the embedded SmolLM2)")
    p.add_argument("--systems", default="ecoserve,ecoserve-core,vllm")
    p.add_argument("--clients", default="ecoserve-bench,vllm-bench")
    p.add_argument("--server-cores", default="0")
    p.add_argument("--client-cores", default="1")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--temperature", type=float, default=None,
                   help="sent by both clients (default: each client's own: ours 0, vLLM's none, so the servers "
                        "apply the model's generation config)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the precision of every server (vLLM's flag, passed to each)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--client-timeout", type=float, default=1800, help="seconds one client run may take")
    p.add_argument("--out", default="results/serve_peers")
    args = p.parse_args(argv)
    args.model_dir = args.model_dir or str(default_model_dir())
    return args


def main() -> int:
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, system in enumerate(args.systems.split(",")):
        port = args.port + i
        cmd, env = server_command(system, args, port)
        with serving(cmd, env, port, args.server_cores, out / f"server-{system}.log", args.ready_timeout) as startup:
            print(f"{system}: ready in {startup:.1f} s", flush=True)
            for client in args.clients.split(","):
                name = f"{system}--{client}.json"
                run_client(client_command(client, args, port, out, name), args.client_cores, args.client_timeout)
                r = json.loads((out / name).read_text())
                rows.append({"system": system, "client": client, "dtype": args.dtype, "startup_s": startup,
                             "completed": r["completed"], "output_throughput": r["output_throughput"],
                             "mean_ttft_ms": r["mean_ttft_ms"], "mean_tpot_ms": r["mean_tpot_ms"],
                             "p99_tpot_ms": r.get("p99_tpot_ms"), "duration_s": r["duration"]})
                print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.num_prompts} requests of {args.input_len} in / {args.output_len} out at {args.request_rate} req/s, "
          f"{args.dtype}, temperature {args.temperature if args.temperature is not None else 'per client'}; "
          f"servers on cores {args.server_cores}, clients on {args.client_cores}")
    print(f"{'system':<15}{'client':<16}{'done':>5}{'out tok/s':>11}{'TTFT ms':>10}{'TPOT ms':>10}{'P99 TPOT':>10}")
    for r in rows:
        print(f"{r['system']:<15}{r['client']:<16}{r['completed']:>5}{r['output_throughput']:>11.1f}"
              f"{r['mean_ttft_ms']:>10.0f}{r['mean_tpot_ms']:>10.0f}{(r['p99_tpot_ms'] or 0):>10.0f}")
    ratios = {}
    for client in args.clients.split(","):
        peer = next((r for r in rows if r["system"] == "vllm" and r["client"] == client), None)
        for r in rows:
            if peer and r["client"] == client and r["system"] != "vllm":
                key = f"{r['system']} / vllm ({client})"
                ratios[key] = {"output_throughput": r["output_throughput"] / peer["output_throughput"],
                               "mean_tpot": r["mean_tpot_ms"] / peer["mean_tpot_ms"]}
                print(f"{key}: output throughput {ratios[key]['output_throughput']:.2f}x, "
                      f"mean TPOT {ratios[key]['mean_tpot']:.2f}x")
    (out / "serve_peers.json").write_text(json.dumps({"args": vars(args), "runs": rows, "ratios": ratios}, indent=2))
    print(f"wrote {out / 'serve_peers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
