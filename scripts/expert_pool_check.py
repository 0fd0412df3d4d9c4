"""Expert offload on one device: a random Mixtral-shaped MoE, every expert resident vs `--moe-resident-experts`.

For each budget: greedy outputs equal to the all-resident run, batch-1 decode time per token, a batch
prefill's tokens/s, and the pool's counts (hits, on-demand loads, host-computed experts, prefetches,
bytes moved); plus the cost table the pool measured (one expert by tokens on each tier, one transfer).
Prints a table and writes expert_pool.json to --out.

  python scripts/expert_pool_check.py --device cuda --out results/device_check
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from ecoserve import LLM, SamplingParams
from tests.utils import make_tiny_moe_checkpoint, prompts

SHAPES = {  # cuda: ~0.5B total, 8 experts of 2 x 1024 x 2816 (+ down) per layer, top-2
    "cuda": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
    "cpu": dict(num_hidden_layers=2),
}


def run(path: str, device: str, dtype: str, budget: int | None, decode_tokens: int) -> dict:
    kw = {} if budget is None else {"moe_resident_experts": budget}
    llm = LLM(path, device=device, dtype=dtype, **kw)
    greedy = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts(16, seed=1, min_len=200, max_len=256)]
    llm.generate(batch[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    out = llm.generate(batch[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    decode_s = (time.perf_counter() - t0) / decode_tokens
    t0 = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    prefill_tok_s = sum(len(b["prompt_token_ids"]) for b in batch) / (time.perf_counter() - t0)
    pool = llm.llm_engine.expert_pool
    row = {"resident_experts": budget, "decode_ms_per_token": decode_s * 1e3, "prefill_tok_s": prefill_tok_s,
           "tokens": out, "stats": pool.stats.as_dict() if pool else None}
    if pool is not None:
        c = pool.policy.costs
        row["costs_ms"] = {"load": c.load_s * 1e3, "host": {n: c.host_s(n) * 1e3 for n in (1, 8, 64, 256)},
                           "device": {n: c.device_s(n) * 1e3 for n in (1, 8, 64, 256)}}
    llm.llm_engine.shutdown()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--budgets", default="0,2,4,6")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--out", default="results/device_check")
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    path = str(make_tiny_moe_checkpoint(tempfile.mkdtemp() + "/moe", "mixtral", **SHAPES[args.device]))
    rows = [run(path, args.device, dtype, None, args.decode_tokens)]
    rows += [run(path, args.device, dtype, int(b), args.decode_tokens) for b in args.budgets.split(",")]
    full = rows[0]
    print(f"{'resident':>8} {'decode ms/tok':>13} {'prefill tok/s':>13} {'same tokens':>11} "
          f"{'hits':>6} {'loads':>6} {'host':>6} {'prefetch':>8} {'MiB moved':>9}")
    for r in rows:
        s = r["stats"] or {}
        print(f"{'all' if r['resident_experts'] is None else r['resident_experts']:>8} "
              f"{r['decode_ms_per_token']:>13.2f} {r['prefill_tok_s']:>13.0f} {str(r['tokens'] == full['tokens']):>11} "
              f"{s.get('hits', '-'):>6} {s.get('loads', '-'):>6} {s.get('host_computed', '-'):>6} "
              f"{s.get('prefetches', '-'):>8} {s.get('bytes_moved', 0) / 2**20:>9.1f}")
    for r in rows[1:2]:
        print("measured cost table (ms):", json.dumps(r["costs_ms"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "expert_pool.json").write_text(json.dumps({"device": args.device, "dtype": dtype, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
