"""Time the live engine's prefill, decode and hybrid steps; estimate the simulator's step-type costs.

Writes `steps.csv` (kind, prompt_tokens, decode_seqs, context, ms: medians) and `step_costs.json`
with the two `StepTypeCosts` parameters of `ecoserve/sim/perf.py`, estimated model-free:
- prompt_step_overhead_s: median over n of T(prefill of one n-token prompt) - T(decode of n
  sequences), i.e. what a step costs more when it carries the same number of tokens as prompt
  rather than as decodes (eager execution vs a captured decode graph, prefill kernels);
- hybrid_decode_token_s: median over (n, b) of (T(hybrid: n prompt tokens + b decodes) -
  T(prefill n) - (T(decode b) - T(decode 1))) / b, i.e. the extra per decode token in a mixed step.
Run by scripts/profile_steps.sh on a GPU machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PREFILL = (16, 64, 128, 256, 512, 1024, 2048)
DECODE = (1, 8, 16, 32, 64, 128)
HYBRID = ((256, 16), (256, 64), (512, 32), (512, 128))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local checkpoint dir or hub id")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=256, help="context of each decoding sequence")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default="results/profile_steps")
    a = ap.parse_args()

    from ecoserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from ecoserve.engine.llm_engine import LLMEngine
    from ecoserve.sampling import SamplingParams

    sched = SchedulerConfig(policy="chunked", max_num_batched_tokens=8192, max_num_seqs=512)
    eng = LLMEngine(EngineConfig(model=a.model, device=a.device, dtype=a.dtype, seed=0, scheduler=sched,
                                 cache=CacheConfig(enable_prefix_caching=False)))
    counter, vocab = 0, eng.loaded.spec.vocab_size
    lens = [n for n in PREFILL if n + 1 <= eng.max_model_len] or [eng.max_model_len // 2]

    def add(n: int, max_tokens: int) -> None:
        nonlocal counter
        counter += 1
        ids = [(counter * 7919 + 13 * i) % vocab for i in range(n)]  # distinct prompts: no prefix hits
        eng.add_request(f"p{counter}", {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))

    def timed() -> float:
        t0 = time.perf_counter()
        eng.step()  # returns after sampling: the device work is done
        return time.perf_counter() - t0

    def drain() -> None:
        while eng.scheduler.has_unfinished_requests():
            eng.step()

    def decoders(b: int) -> None:
        for _ in range(b):
            add(a.context, 10_000)
        eng.step()  # their prompts, in one step

    def prefill(n: int) -> float:
        ts = []
        for _ in range(a.reps):
            add(n, 1)
            ts.append(timed())
            drain()
        return statistics.median(ts)

    def decode(b: int) -> float:
        decoders(b)
        ts = [timed() for _ in range(a.reps)]
        eng.abort_request([f"p{i}" for i in range(counter - b + 1, counter + 1)])
        drain()
        return statistics.median(ts)

    def hybrid(n: int, b: int) -> float:
        decoders(b)
        ts = []
        for _ in range(a.reps):
            add(n, 1)
            ts.append(timed())  # the new prompt and the b decodes in one chunked step
        eng.abort_request([f"p{i}" for i in range(counter - b - a.reps + 1, counter + 1)])
        drain()
        return statistics.median(ts)

    prefill(64)  # warm-up (kernels, allocator, graphs)
    decode(8)
    rows, t_pre, t_dec = [], {}, {}
    for n in lens:
        t_pre[n] = prefill(n)
        rows.append(("prefill", n, 0, 0, t_pre[n]))
    for b in DECODE:
        t_dec[b] = decode(b)
        rows.append(("decode", 0, b, a.context, t_dec[b]))
    hyb = []
    for n, b in HYBRID:
        if n not in t_pre:
            continue
        t = hybrid(n, b)
        rows.append(("hybrid", n, b, a.context, t))
        hyb.append((t - t_pre[n] - (t_dec.get(b, t_dec[max(DECODE)]) - t_dec[1])) / b)
    overhead = [t_pre[n] - t_dec[n] for n in lens if n in t_dec]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.csv").write_text("kind,prompt_tokens,decode_seqs,context,ms\n" + "".join(
        f"{k},{n},{b},{c},{1e3 * t:.3f}\n" for k, n, b, c, t in rows))
    costs = {"prompt_step_overhead_s": max(statistics.median(overhead), 0.0) if overhead else None,
             "hybrid_decode_token_s": max(statistics.median(hyb), 0.0) if hyb else None,
             "model": a.model, "device": a.device, "dtype": a.dtype, "context": a.context}
    (out / "step_costs.json").write_text(json.dumps(costs, indent=1))
    print(json.dumps(costs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
