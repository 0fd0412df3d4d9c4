"""The linears of one decode step, alone: oneDNN's prepacked GEMM against the native decode-rows loop
(kernels/skinny_linear.cpp) on the same packed weights, at a few rows. The shapes are the 125M Qwen3 of the
benchmarks (12 layers of qkv 1280x768, o 768x768, gate_up 4096x768, down 768x2048, and a 32000x768 LM head),
each layer's weights distinct, so they stream from memory as in a decode, not from cache as a repeated layer
would. Prints ms per step and weight GB/s per path, and writes JSON.

    PYTHONPATH=$PWD python scripts/bench_skinny_linear.py --threads 2 --json results/precision/skinny_2thread.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from ecoserve.kernels import skinny_linear
from ecoserve.model.packed import pack_weight, packed_linear

LAYERS = 12
SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)]
LM_HEAD = (32000, 768)


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kernel = skinny_linear()
    if kernel is None:
        raise SystemExit("the native skinny_linear kernel is not built")
    rows_out = []
    print(f"{'dtype':<9} {'rows':>4} {'oneDNN ms':>10} {'GB/s':>6} {'native ms':>10} {'GB/s':>6} {'oneDNN/native':>14}"
          f"  (engine uses native up to)")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(o, i, generator=gen).to(dtype) for _ in range(LAYERS) for o, i in SHAPES]
        weights.append(torch.randn(*LM_HEAD, generator=gen).to(dtype))
        packed = [pack_weight(w) for w in weights]
        layouts = [kernel.fit(p_, w) for p_, w in zip(packed, weights)]
        if not all(layout[0] for layout in layouts):
            raise SystemExit(f"{name}: oneDNN's layout was not recognised for every shape; nothing to compare")
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {w.shape[1] for w in weights}}
            onednn = best_ms(lambda: [packed_linear(xs[w.shape[1]], p_) for w, p_ in zip(weights, packed)],
                             args.repeats)
            native = best_ms(lambda: [kernel.skinny_linear(xs[w.shape[1]], p_, None, w.shape[0], *layout)
                                      for w, p_, layout in zip(weights, packed, layouts)], args.repeats)
            row = {"dtype": name, "rows": rows, "onednn_ms": onednn, "native_ms": native,
                   "onednn_gbps": nbytes / onednn / 1e6, "native_gbps": nbytes / native / 1e6,
                   "ratio": onednn / native}
            rows_out.append(row)
            print(f"{name:<9} {rows:>4} {onednn:>10.2f} {row['onednn_gbps']:>6.1f} {native:>10.2f} "
                  f"{row['native_gbps']:>6.1f} {row['ratio']:>13.2f}x  {kernel.max_rows(dtype)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "machine": platform.processor() or platform.machine(),
                                         "weight_bytes_per_step": nbytes, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
