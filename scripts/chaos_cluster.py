"""Chaos run: a steady load on a live cluster while a loop SIGKILLs or SIGSTOPs a random instance.

    python scripts/chaos_cluster.py --duration 60 --seed 0 --out results/chaos

1. Starts `ecoserve serve --strategy S --num-instances N` (the embedded SmolLM2 unless --model) with
   stream migration and instance restarts on.
2. Reference: every prompt once, greedy and seeded, with no fault.
3. Chaos: `--concurrency` clients send streaming completions back to back (greedy and seeded in turn)
   for `--duration` seconds, while the fault loop waits until all N instances are ready, waits
   `--fault-interval` seconds (jittered), and SIGKILLs or SIGSTOPs one ready instance at random.
4. Every accepted request must end with its whole output or a clear error by its deadline; a request
   with neither is *lost*. A completed output must equal its reference (greedy and seeded alike).

Prints a table and writes OUT/chaos.json: requests accepted, completed, migrated, failed with an
error, lost, mismatched; the p50/p99 of the extra latency of migrated requests (their end-to-end
time against the same prompt's fault-free time under the same load); and the time from each fault
to the cluster being back to N ready instances. Exit status 1 when a request was lost, a migrated
stream mismatched, more than `--max-mismatched-fraction` of the outputs mismatched, or the cluster
did not recover. Each mismatch is recorded with where it first differs, to tell a divergence (a
different token) from a stream fault (text dropped or repeated).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from bench_cluster import free_port  # noqa: E402 (a script beside this one)
from validate_sim import wait_ready  # noqa: E402

CLI = [sys.executable, "-m", "ecoserve.cli"]
PROMPTS = [
    "The quick brown fox", "Once upon a time in a small village", "The capital of France is",
    "In the beginning the universe was", "A good recipe for bread needs", "The history of computing began",
    "My favourite season of the year is", "The best way to learn a language is",
]


@dataclass
class Result:
    key: str  # prompt index and sampling ("3/greedy", "3/seeded")
    request_id: str = ""
    text: str = ""
    error: str | None = None
    start: float = 0.0
    end: float = 0.0
    accepted: bool = False  # the server answered 200 and the stream began
    finished: bool = False  # the stream ended with a finish reason and [DONE]
    max_gap_s: float = 0.0

    @property
    def e2e(self) -> float:
        return self.end - self.start


@dataclass
class Fault:
    kind: str  # SIGKILL | SIGSTOP
    instance: int
    pid: int
    at: float
    ready_after_s: float | None = None  # until N instances were ready again


@dataclass
class Run:
    results: list[Result] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)


def payload(key: str, model: str, max_tokens: int) -> dict:
    index, mode = key.split("/")
    body = {"model": model, "prompt": PROMPTS[int(index) % len(PROMPTS)], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    if mode == "greedy":
        body["temperature"] = 0.0
    else:
        body.update(temperature=0.8, top_p=0.95, seed=1000 + int(index))
    return body


async def send(session: aiohttp.ClientSession, url: str, key: str, model: str, max_tokens: int,
               deadline_s: float) -> Result:
    """One streaming completion; never raises: what went wrong is in the result."""
    r = Result(key, start=time.monotonic())
    last = r.start
    try:
        async with session.post(f"{url}/v1/completions", json=payload(key, model, max_tokens),
                                timeout=aiohttp.ClientTimeout(total=deadline_s)) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            r.accepted = True
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    r.error = event["error"].get("message", str(event["error"]))
                    continue
                r.request_id = r.request_id or event.get("id", "")
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        now = time.monotonic()
                        r.max_gap_s = max(r.max_gap_s, now - last)
                        last = now
                        r.text += choice["text"]
                    if choice.get("finish_reason"):
                        r.finished = True
    except asyncio.TimeoutError:
        r.error = None  # no end by the deadline: lost
        r.finished = False
    except aiohttp.ClientError as e:
        r.error = f"connection: {e!r}"
    finally:
        r.end = time.monotonic()
    if r.finished and r.error is not None:
        r.finished = False
    return r


async def cluster_state(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/cluster", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.json()


async def load(session, url: str, a: argparse.Namespace, keys: list[str], until: float, run: Run) -> None:
    """`a.concurrency` closed-loop clients cycling through `keys`."""
    order = iter(range(10 ** 9))

    async def client() -> None:
        while time.monotonic() < until:
            key = keys[next(order) % len(keys)]
            run.results.append(await send(session, url, key, a.served_name, a.max_tokens, a.request_deadline))

    await asyncio.gather(*(client() for _ in range(a.concurrency)))


async def faults(session, url: str, a: argparse.Namespace, until: float, run: Run, rng: random.Random) -> None:
    """Wait for full strength, wait the interval, hit a random ready instance; record the recovery time."""
    while time.monotonic() < until:
        await asyncio.sleep(min(a.fault_interval * rng.uniform(0.5, 1.5), max(until - time.monotonic(), 0.0)))
        if time.monotonic() >= until:
            return
        ready = [i for i in (await cluster_state(session, url))["instances"] if i["state"] == "ready" and i["pid"]]
        if not ready:
            continue
        victim = rng.choice(ready)
        kind = rng.choice(["SIGKILL", "SIGSTOP"])
        fault = Fault(kind, victim["id"], victim["pid"], time.monotonic())
        try:
            os.kill(victim["pid"], getattr(signal, kind))
        except ProcessLookupError:
            continue
        run.faults.append(fault)
        fault.ready_after_s = await wait_full(session, url, a, fault.at, victim["pid"])
        if fault.ready_after_s is None:
            return  # did not recover: stop hitting it (the run reports the failure)


async def wait_full(session, url: str, a: argparse.Namespace, since: float, old_pid: int) -> float | None:
    """Seconds from `since` until N instances are ready and none of them is the process just hit."""
    deadline = since + a.recovery_deadline
    while time.monotonic() < deadline:
        inst = (await cluster_state(session, url))["instances"]
        ready = [i for i in inst if i["state"] == "ready"]
        if len(ready) >= a.num_instances and all(i["pid"] != old_pid for i in ready):
            return time.monotonic() - since
        await asyncio.sleep(0.1)
    return None


async def main_async(a: argparse.Namespace, url: str) -> dict:
    rng = random.Random(a.seed)
    keys = [f"{i}/{mode}" for i in range(len(PROMPTS)) for mode in ("greedy", "seeded")]
    async with aiohttp.ClientSession() as session:
        reference = {}
        for key in keys:  # alone, no fault: the outputs every later run must equal
            r = await send(session, url, key, a.served_name, a.max_tokens, a.request_deadline)
            if not r.finished:
                raise RuntimeError(f"the fault-free reference request {key} failed: {r.error}")
            reference[key] = r.text
        calm = Run()  # the same load without faults: each prompt's fault-free latency under load
        await load(session, url, a, keys, time.monotonic() + a.calm_duration, calm)
        chaos = Run()
        until = time.monotonic() + a.duration
        await asyncio.gather(load(session, url, a, keys, until, chaos), faults(session, url, a, until, chaos, rng))
        final = await wait_full(session, url, a, time.monotonic(), -1)
        state = await cluster_state(session, url)
    return summarize(a, reference, calm, chaos, state, final is not None)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(a: argparse.Namespace, reference: dict[str, str], calm: Run, chaos: Run, state: dict,
              recovered: bool) -> dict:
    calm_e2e: dict[str, list[float]] = {}
    for r in calm.results:
        if r.finished:
            calm_e2e.setdefault(r.key, []).append(r.e2e)
    migrated_ids = {m["request_id"] for m in state.get("recent_migrations", [])}
    res = chaos.results
    completed = [r for r in res if r.finished]
    mismatched = [r for r in completed if r.text != reference[r.key]]
    failed = [r for r in res if not r.finished and r.error is not None]
    lost = [r for r in res if not r.finished and r.error is None]
    migrated = [r for r in completed if f"{r.request_id}-0" in migrated_ids]
    mismatched_migrated = [r for r in migrated if r.text != reference[r.key]]
    extra = [r.e2e - statistics.median(calm_e2e[r.key]) for r in migrated if r.key in calm_e2e]
    recovery = [f.ready_after_s for f in chaos.faults if f.ready_after_s is not None]
    counters = state.get("counters", {})
    summary = {
        "strategy": a.strategy, "num_instances": a.num_instances, "duration_s": a.duration,
        "concurrency": a.concurrency, "max_tokens": a.max_tokens, "seed": a.seed,
        "faults": len(chaos.faults), "sigkill": sum(f.kind == "SIGKILL" for f in chaos.faults),
        "sigstop": sum(f.kind == "SIGSTOP" for f in chaos.faults),
        "requests": len(res), "accepted": sum(r.accepted for r in res), "completed": len(completed),
        "migrated": len(migrated), "failed_with_error": len(failed), "lost": len(lost),
        "mismatched": len(mismatched), "mismatched_migrated": len(mismatched_migrated),
        "migration_extra_latency_p50_s": percentile(extra, 50), "migration_extra_latency_p99_s": percentile(extra, 99),
        "recovery_s_p50": percentile(recovery, 50), "recovery_s_max": max(recovery) if recovery else None,
        "unrecovered_faults": sum(f.ready_after_s is None for f in chaos.faults), "recovered_at_end": recovered,
        "counters": counters,
        "errors": sorted({r.error for r in failed})[:10],
        "mismatch_keys": sorted({r.key for r in mismatched})[:10],
        "mismatches": [divergence(r, reference[r.key]) for r in mismatched[:10]],
        "fault_log": [asdict(f) for f in chaos.faults],
    }
    return summary


def divergence(r: Result, want: str) -> dict:
    """Where a mismatched output first differs from its reference, with a little context either side."""
    at = next((i for i, (a, b) in enumerate(zip(r.text, want)) if a != b), min(len(r.text), len(want)))
    return {"key": r.key, "request_id": r.request_id, "at_char": at, "got_len": len(r.text), "want_len": len(want),
            "got": r.text[max(at - 20, 0):at + 40], "want": want[max(at - 20, 0):at + 40]}


def table(s: dict) -> str:
    def fmt(v) -> str:
        return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)

    rows = [("faults (SIGKILL / SIGSTOP)", f"{s['faults']} ({s['sigkill']} / {s['sigstop']})"),
            ("requests accepted", s["accepted"]), ("completed", s["completed"]), ("migrated", s["migrated"]),
            ("failed with an error", s["failed_with_error"]), ("lost", s["lost"]),
            ("outputs unequal to the fault-free run (of them migrated)",
             f"{s['mismatched']} ({s['mismatched_migrated']})"),
            ("migration extra latency p50 / p99 (s)",
             f"{fmt(s['migration_extra_latency_p50_s'])} / {fmt(s['migration_extra_latency_p99_s'])}"),
            ("fault to N ready, p50 / max (s)", f"{fmt(s['recovery_s_p50'])} / {fmt(s['recovery_s_max'])}"),
            ("faults not recovered from", s["unrecovered_faults"])]
    lines = ["| chaos run | value |", "|---|---|"] + [f"| {k} | {fmt(v)} |" for k, v in rows]
    return "\n".join(lines)


def serve_cmd(a: argparse.Namespace, port: int) -> list[str]:
    cmd = [*CLI, "serve", "--strategy", a.strategy, "--num-instances", str(a.num_instances), "--num-threads", "1",
           "--port", str(port), "--served-model-name", a.served_name, "--uvicorn-log-level", "warning",
           "--max-migrations", str(a.max_migrations), "--max-instance-restarts", "1000",
           "--instance-restart-backoff", "0.5", "--max-num-seqs", "16"]
    if a.model:
        cmd += ["--model", a.model]
    return cmd + a.serve_arg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--strategy", default="vllm")
    p.add_argument("--num-instances", type=int, default=3)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load with faults")
    p.add_argument("--calm-duration", type=float, default=15.0, help="seconds of the same load without faults")
    p.add_argument("--fault-interval", type=float, default=6.0, help="mean seconds between full strength and a fault")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-migrations", type=int, default=3)
    p.add_argument("--request-deadline", type=float, default=120.0)
    p.add_argument("--recovery-deadline", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-mismatched-fraction", type=float, default=0.0,
                   help="outputs of streams that did not migrate allowed to differ from the reference (default 0)")
    p.add_argument("--served-name", default="chaos")
    p.add_argument("--serve-arg", action="append", default=[], help="one more `ecoserve serve` argument")
    p.add_argument("--out", default="results/chaos")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(out / "server.log", "w")
    server = subprocess.Popen(serve_cmd(a, port), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_ready(port, server, 300.0, path="/health")
        summary = asyncio.run(main_async(a, url))
    finally:
        stop(server)
    summary["command"] = " ".join(["python", "scripts/chaos_cluster.py", *(argv if argv is not None else sys.argv[1:])])
    (out / "chaos.json").write_text(json.dumps(summary, indent=2))
    print(table(summary))
    ok = summary["lost"] == 0 and summary["mismatched_migrated"] == 0 and summary["recovered_at_end"] and \
        summary["mismatched"] <= a.max_mismatched_fraction * summary["completed"] and summary["unrecovered_faults"] == 0
    return 0 if ok else 1


def stop(server: subprocess.Popen) -> None:
    """SIGTERM: the frontend shuts its instances down; then SIGKILL whatever is left of its process group."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
