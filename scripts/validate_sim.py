"""Validate the simulator against the live engine on this machine: one instance, `chunked` policy.

The cluster-level check (2 real instances, every strategy, a measured prefill/decode/hybrid
step profile) is its successor, scripts/validate_cluster.py; this script keeps the single-instance
check and the `tokens,ms` profile that scripts/bench_cluster.py's mock instances sleep.

1. Profile: time the live engine's steps (`LLMEngine.step()`, one torch thread) of n tokens -> a
   `tokens,ms` CSV (TD-Pipe's format): decode batches of n sequences up to 16, single prompts above.
2. Live: start `ecoserve serve --num-threads 1` and run `ecoserve bench serve` against it from a
   separate process (random dataset, Poisson arrivals, --ignore-eos, --save-result).
3. Simulated: the same requests (same dataset code and arrival seed as the bench) on one simulated
   instance with the server's scheduler settings and the measured profile.
4. Report mean / p90 TTFT and TPOT of both (the common definitions: first streamed token; (e2e -
   TTFT) / (output - 1)) and their absolute percentage errors.

    python scripts/validate_sim.py --out results/validate            # ~5 min on one core
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROFILE_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 384, 512)


def measure_profile(model: str | None, num_threads: int, path: Path, reps: int = 7, decode_upto: int = 16,
                    decode_context: int = 80) -> list[tuple[int, float]]:
    """Median wall time of one live engine step (`LLMEngine.step()`) of n tokens.

    The rows are measured with the step shapes a serving workload produces: up to `decode_upto`
    tokens, a decode step of n sequences with `decode_context` tokens of context each (per-sequence
    work: sampling, block tables, attention over the context); above it, one prompt of n tokens.
    """
    from ecoserve.config import EngineConfig
    from ecoserve.engine.llm_engine import LLMEngine
    from ecoserve.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(model=model, num_threads=num_threads, seed=0))
    counter = 0

    def add(n_tokens: int, max_tokens: int) -> None:
        nonlocal counter
        counter += 1
        ids = [100 + (counter * 7919 + 13 * i) % 20000 for i in range(n_tokens)]  # distinct: no prefix hits
        eng.add_request(f"profile-{counter}", {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))

    def drain() -> None:
        while eng.scheduler.has_unfinished_requests():
            eng.step()

    def timed_step() -> float:
        t0 = time.perf_counter()
        eng.step()
        return time.perf_counter() - t0

    def prefill(n: int) -> float:
        add(n, 1)
        dt = timed_step()
        drain()
        return dt

    def decode(b: int) -> float:
        for _ in range(b):
            add(decode_context, reps + 2)
        eng.step()  # all prompts in one step
        times = [timed_step() for _ in range(reps)]
        drain()
        return statistics.median(times)

    for _ in range(3):
        prefill(32)  # warm-up
    decode(2)
    rows = []
    for n in PROFILE_TOKENS:
        ms = 1e3 * (decode(n) if n <= decode_upto else statistics.median(prefill(n) for _ in range(reps)))
        rows.append((n, ms))
        print(f"profile: {n:4d} tokens {ms:8.1f} ms ({'decode' if n <= decode_upto else 'prefill'})", flush=True)
    path.write_text("Total Length,Execute Time\n" + "".join(f"{n},{ms:.3f}\n" for n, ms in rows))
    return rows


def bench_args(a: argparse.Namespace, port: int, out: Path) -> list[str]:
    return ["--base-url", f"http://127.0.0.1:{port}", "--tokenizer", a.model_dir, "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
            "--random-range-ratio", str(a.range_ratio), "--num-prompts", str(a.num_prompts),
            "--request-rate", str(a.rate), "--seed", str(a.seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", str(out), "--result-filename", "live.json", "--disable-tqdm"]


def wait_ready(port: int, server: subprocess.Popen, timeout_s: float = 300.0, path: str = "/v1/models") -> None:
    """Until GET `path` answers 200 (a cluster: /health, once every instance has joined)."""
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with code {server.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5):
                return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"the server did not answer on port {port} within {timeout_s:.0f} s")


def run_live(a: argparse.Namespace, out: Path) -> dict:
    server_cmd = [sys.executable, "-m", "ecoserve.cli", "serve", "--num-threads", "1", "--port", str(a.port),
                  "--uvicorn-log-level", "warning"]
    if a.model:
        server_cmd += ["--model", a.model]
    log = open(out / "server.log", "w")
    server = subprocess.Popen(server_cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(a.port, server)
        subprocess.run([sys.executable, "-m", "ecoserve.cli", "bench", "serve", *bench_args(a, a.port, out)],
                       check=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    return json.loads((out / "live.json").read_text())


def workload(a: argparse.Namespace):
    """The bench's own requests and send times, rebuilt with its code and seed."""
    from ecoserve.bench.datasets import load_tokenizer, sample_requests
    from ecoserve.bench.serve import add_cli_args, arrival_times
    from ecoserve.sim.workload import SimRequest

    p = argparse.ArgumentParser()
    add_cli_args(p)
    args = p.parse_args(bench_args(a, a.port, Path("unused")))
    reqs = sample_requests(args, load_tokenizer(a.model_dir), as_text=False)
    times = arrival_times(len(reqs), args.request_rate, args.burstiness, np.random.default_rng(args.seed))
    return [SimRequest(f"v{i}", float(t), r.prompt_len, r.expected_output_len) for i, (r, t) in enumerate(zip(reqs, times))]


def run_sim(a: argparse.Namespace, profile: Path) -> dict:
    from ecoserve.config import SchedulerConfig
    from ecoserve.sim.cluster import ClusterSpec
    from ecoserve.sim.cluster import build

    sc = SchedulerConfig()  # the server's defaults: chunked policy, 2048-token budget, 256 seats
    spec = ClusterSpec(model=a.model_dir, gpu="L20", tp=1, num_instances=1, profile=str(profile),
                       max_num_batched_tokens=sc.max_num_batched_tokens, chunk_size=sc.max_num_batched_tokens,
                       max_num_seqs=sc.max_num_seqs, perf_knobs={"kv_bytes_per_token": 0.0})
    if sc.policy != "chunked":
        raise SystemExit(f"the server's default policy is now {sc.policy!r}; update this script's strategy")
    res = build("sarathi", spec, ttft_slo=1e9, tpot_slo=1e9).run(workload(a))
    ttft = np.array([r.first_token - r.arrival for r in res.records])
    tpot = np.array([(r.finish - r.first_token) / (r.output_len - 1) for r in res.records if r.output_len > 1])
    return {"mean_ttft_ms": 1e3 * ttft.mean(), "p90_ttft_ms": 1e3 * np.percentile(ttft, 90),
            "mean_tpot_ms": 1e3 * tpot.mean(), "p90_tpot_ms": 1e3 * np.percentile(tpot, 90),
            "completed": len(res.records)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model dir for serve/profile (default: the embedded SmolLM2)")
    p.add_argument("--out", default="results/validate")
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--rate", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-live", action="store_true", help="reuse OUT/profile.csv and OUT/live.json")
    p.add_argument("--profile", default=None, help="reuse this tokens,ms CSV instead of measuring one")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.model:
        a.model_dir = a.model
    else:
        from ecoserve.model.default import default_model_dir
        a.model_dir = str(default_model_dir())
    profile = Path(a.profile) if a.profile else out / "profile.csv"
    if not a.skip_live:
        if not a.profile:
            measure_profile(a.model, 1, profile)
        live = run_live(a, out)
    else:
        live = json.loads((out / "live.json").read_text())
    sim = run_sim(a, profile)
    keys = ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p90_tpot_ms")
    rows = {k: {"live": live[k], "sim": sim[k], "ape": abs(sim[k] - live[k]) / live[k]} for k in keys}
    mape = sum(r["ape"] for r in rows.values()) / len(rows)
    print("| metric | live | simulated | abs. error |\n|---|---|---|---|")
    for k, r in rows.items():
        print(f"| {k} | {r['live']:.1f} | {r['sim']:.1f} | {100 * r['ape']:.1f}% |")
    print(f"MAPE over the four: {100 * mape:.1f}%  (live completed {live.get('completed')}, sim {sim['completed']})")
    (out / "validate.json").write_text(json.dumps({"args": vars(a), "rows": rows, "mape": mape,
                                                   "load_avg_end": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
