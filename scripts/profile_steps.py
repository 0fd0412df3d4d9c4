"""Time the live engine's prefill, decode and hybrid steps; estimate the simulator's step-type costs.

Writes `steps.csv` (kind, prompt_tokens, decode_seqs, context, ms: medians), the profile that the
simulator's `StepProfilePerf` reads (`ClusterSpec(profile=...)`): prefill steps by prompt tokens,
decode steps on a (sequences x context) grid, hybrid steps on a (prompt tokens x decodes) grid at
the first context. A decode row's context is the mean over its timed steps. Also `step_costs.json`
with the two `StepTypeCosts` parameters of `ecoserve/sim/perf.py`, estimated model-free:
- prompt_step_overhead_s: median over n of T(prefill of one n-token prompt) - T(decode of n
  sequences), i.e. what a step costs more when it carries the same number of tokens as prompt
  rather than as decodes (eager execution vs a captured decode graph, prefill kernels);
- hybrid_decode_token_s: median over (n, b) of (T(hybrid: n prompt tokens + b decodes) -
  T(prefill n) - (T(decode b) - T(decode 1))) / b, i.e. the extra per decode token in a mixed step.
Run by scripts/profile_steps.sh (a GPU, or `cpu float32` with one torch thread for the live CPU cluster).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

PREFILL = (16, 64, 128, 256, 512, 1024, 2048)
DECODE = (1, 8, 16, 32, 64, 128)
HYBRID_PROMPTS = (256, 512)
HYBRID_DECODES = (16, 64)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local checkpoint dir or hub id ('default': the embedded model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    ap.add_argument("--prefill", type=ints, default=PREFILL, help="prompt lengths of the prefill rows")
    ap.add_argument("--decode", type=ints, default=DECODE, help="sequences of the decode rows")
    ap.add_argument("--context", type=ints, default=(256,), help="contexts of the decode rows (the first: hybrid)")
    ap.add_argument("--hybrid-prompts", type=ints, default=HYBRID_PROMPTS)
    ap.add_argument("--hybrid-decodes", type=ints, default=HYBRID_DECODES)
    ap.add_argument("--reps", type=int, default=9, help="timed steps per point and pass")
    ap.add_argument("--passes", type=int, default=1, help="passes over the whole grid (medians over all)")
    ap.add_argument("--out", default="results/profile_steps")
    a = ap.parse_args()

    from ecoserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from ecoserve.engine.llm_engine import LLMEngine
    from ecoserve.sampling import SamplingParams

    sched = SchedulerConfig(policy="chunked", max_num_batched_tokens=8192, max_num_seqs=512)
    model = None if a.model == "default" else a.model
    eng = LLMEngine(EngineConfig(model=model, device=a.device, dtype=a.dtype, seed=0, scheduler=sched,
                                 num_threads=a.num_threads, cache=CacheConfig(enable_prefix_caching=False)))
    counter, vocab = 0, eng.loaded.spec.vocab_size
    lens = [n for n in a.prefill if n + 1 <= eng.max_model_len] or [eng.max_model_len // 2]
    hybrid_prompts = [n for n in a.hybrid_prompts if n + 1 <= eng.max_model_len]
    c0 = a.context[0]

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

    def decoders(b: int, context: int) -> None:
        for _ in range(b):
            add(context, 10_000)
        eng.step()  # their prompts, in one step

    def prefill(n: int) -> list[float]:
        ts = []
        for _ in range(a.reps):
            add(n, 1)
            ts.append(timed())
            drain()
        return ts

    def decode(b: int, context: int) -> list[float]:
        decoders(b, context)
        ts = [timed() for _ in range(a.reps)]
        eng.abort_request([f"p{i}" for i in range(counter - b + 1, counter + 1)])
        drain()
        return ts

    def hybrid(n: int, b: int) -> list[float]:
        decoders(b, c0)
        ts = []
        for _ in range(a.reps):
            add(n, 1)
            ts.append(timed())  # the new prompt and the b decodes in one chunked step
        eng.abort_request([f"p{i}" for i in range(counter - b - a.reps + 1, counter + 1)])
        drain()
        return ts

    prefill(64)  # warm-up (kernels, allocator, graphs)
    decode(8, c0)
    mean_ctx = {c: c + (a.reps + 1) // 2 for c in a.context}  # each timed step adds one token of context
    points = ([(("prefill", n, 0, 0), lambda n=n: prefill(n)) for n in lens]
              + [(("decode", 0, b, mean_ctx[c]), lambda b=b, c=c: decode(b, c)) for c in a.context for b in a.decode]
              + [(("hybrid", n, b, mean_ctx[c0]), lambda n=n, b=b: hybrid(n, b))
                 for n in hybrid_prompts for b in a.hybrid_decodes])
    samples: dict[tuple, list[float]] = {key: [] for key, _ in points}
    for i in range(a.passes):  # whole passes over the grid: a burst of load spreads over many points
        for key, measure in points:
            samples[key] += measure()
        print(f"pass {i + 1}/{a.passes} done", flush=True)
    rows = [(*key, statistics.median(ts)) for key, ts in samples.items()]
    for k, n, b, c, t in rows:
        print(f"{k:8s} prompt {n:5d} decodes {b:4d} context {c:5d} {1e3 * t:8.1f} ms", flush=True)
    t_pre = {n: t for k, n, _, _, t in rows if k == "prefill"}
    t_dec = {(b, c): t for k, _, b, c, t in rows if k == "decode"}
    c0m = mean_ctx[c0]
    hyb = [(t - t_pre[n] - (t_dec[b, c0m] - t_dec[1, c0m])) / b for k, n, b, _, t in rows
           if k == "hybrid" and n in t_pre and (b, c0m) in t_dec and (1, c0m) in t_dec]
    overhead = [t_pre[n] - t_dec[n, c0m] for n in lens if (n, c0m) in t_dec]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "steps.csv").write_text("kind,prompt_tokens,decode_seqs,context,ms\n" + "".join(
        f"{k},{n},{b},{c},{1e3 * t:.3f}\n" for k, n, b, c, t in rows))
    costs = {"prompt_step_overhead_s": max(statistics.median(overhead), 0.0) if overhead else None,
             "hybrid_decode_token_s": max(statistics.median(hyb), 0.0) if hyb else None,
             "model": a.model, "device": a.device, "dtype": a.dtype, "context": c0, "num_threads": a.num_threads}
    (out / "step_costs.json").write_text(json.dumps(costs, indent=1))
    print(json.dumps(costs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
