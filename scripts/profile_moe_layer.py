"""Where one MoE layer's time goes, per token count: routing, GEMMs, gather/sort/combine ops, and the rest.

Builds one `SparseMoeBlock` (default: the benchmark's Qwen3-MoE layer, 64 experts of 256, hidden 768, top-8)
with random weights and times, for each token count, the median of: the router and top-k (`route`), the
routed experts (`block.experts`) and, with torch.profiler over the experts, the self time of its GEMM ops
(oneDNN / torch linear) and of its other aten ops (sort, bincount, gather, scale, index_add_), as shares of the
profiled wall time applied to the unprofiled one. What no aten op
accounts for is Python and native calls outside aten (the per-expert path's SiLU-and-mul; the native kernel's
single call, shown as `native`). `--experts-path` picks the compute: `native` (kernels/moe_experts.cpp),
`onednn` (per-expert oneDNN-packed GEMMs) or `plain` (per-expert torch GEMMs). Run it on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench_moe_experts import add_layer_args, start
from ecoserve.bench.roofline import median_ms
from ecoserve.model.moe import SparseMoeBlock, route
from ecoserve.model.packed import NativeExperts, PackedExperts
from ecoserve.model.spec import MoESpec

GEMM_OPS = {"mkldnn::_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm", "aten::matmul"}


def aten_shares(fn, repeats: int) -> tuple[float, float]:
    """(GEMM ops' share, other aten ops' share) of fn's wall time under torch.profiler (shares, not its
    inflated times, are what carry over to an unprofiled call)."""
    with profile(activities=[ProfilerActivity.CPU]):  # the profiler's own first-use cost, not counted
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        wall_us = (time.perf_counter() - start) * 1e6
    gemm = other = 0.0
    for event in prof.key_averages():
        if event.key.startswith(("aten::", "mkldnn::")):
            if event.key in GEMM_OPS:
                gemm += event.self_cpu_time_total
            else:
                other += event.self_cpu_time_total
    return min(gemm / wall_us, 1.0), min(other / wall_us, 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_layer_args(p, tokens=[1, 16, 256])
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--experts-path", nargs="+", default=["onednn", "native"], choices=["native", "onednn", "plain"])
    args = p.parse_args()
    start(args)
    dtype = getattr(torch, args.dtype)
    moe = MoESpec(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.intermediate,
                  norm_topk_prob=True, weights_in_model_dtype=True)
    rows = []
    print(f"{args.experts} experts of {args.intermediate}, hidden {args.hidden}, top-{args.top_k}, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s); ms per layer call (share of routing + experts)")
    print(f"{'path':<8}{'tokens':>7}{'routing':>16}{'GEMM ops':>16}{'other aten':>16}{'native/Python':>16}"
          f"{'total ms':>10}")
    with torch.inference_mode():
        for path in args.experts_path:
            block = SparseMoeBlock(args.hidden, moe, dtype)
            for param in block.parameters():
                param.copy_(0.02 * torch.randn(param.shape))
            if path == "native":
                if not NativeExperts.supports(dtype):
                    print(f"{path}: the native kernel does not run {args.dtype} here")
                    continue
                block.pack_experts(NativeExperts(block.w_gate_up.data, block.w_down.data))
            elif path == "onednn":
                block.pack_experts(PackedExperts(block.w_gate_up.data, block.w_down.data))
            for tokens in args.tokens:
                x = torch.randn(tokens, args.hidden).to(dtype)
                weights, ids = route(block.gate(x), moe.top_k, moe.norm_topk_prob, dtype)
                routing_ms = median_ms(lambda: route(block.gate(x), moe.top_k, moe.norm_topk_prob, dtype),
                                       args.repeats)
                experts_ms = median_ms(lambda: block.experts(x, ids, weights), args.repeats)
                gemm_share, other_share = aten_shares(lambda: block.experts(x, ids, weights), args.repeats)
                gemm_ms, other_ms = gemm_share * experts_ms, other_share * experts_ms
                rest_ms = max(experts_ms - gemm_ms - other_ms, 0.0)
                total = routing_ms + experts_ms
                rows.append(dict(path=path, tokens=tokens, routing_ms=routing_ms, gemm_ms=gemm_ms,
                                 other_aten_ms=other_ms, native_or_python_ms=rest_ms, total_ms=total))
                cells = "".join(f"{ms:>8.3f} ({100 * ms / total:>3.0f}%)" for ms in (routing_ms, gemm_ms, other_ms,
                                                                                      rest_ms))
                print(f"{path:<8}{tokens:>7}{cells}{total:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
