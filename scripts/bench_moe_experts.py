"""Time the grouped expert compute of ecoserve.model.moe against transformers' per-expert loop, per token count.

One MoE layer's routed experts (default: the benchmark's Qwen3-MoE, 64 experts of 256, hidden 768, top-8)
over T tokens with random routing: `grouped` is `fused_experts` (sort the (token, expert) pairs by expert,
one gate/up and one down GEMM per active expert, one index_add) on plain stacked weights (torch's GEMM),
`packed` the same over oneDNN-prepacked experts (model/packed.py's `PackedExperts`, the engine's fallback
in bfloat16 and under `--cpu-linear onednn`), `native` the grouped kernel kernels/moe_experts.cpp (one call
per layer; model/packed.py's `NativeExperts`, what the engine runs where it builds); `loop` is transformers'
`Qwen3MoeExperts.forward` with the same weights (a one-hot mask per expert, torch.where, index_add per
expert). Prints the median ms per call of each after a warm-up, the loop's time over the fastest grouped
path's, and the weight bytes the active experts stream per call; `--json` writes the rows. Run it on an idle machine, e.g.
`taskset -c 0 python scripts/bench_moe_experts.py --threads 1`.
"""
from __future__ import annotations

import argparse
import json

import torch

from ecoserve.bench.roofline import median_ms
from ecoserve.model.moe import fused_experts
from ecoserve.model.packed import NativeExperts, PackedExperts, onednn_available

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_layer_args(p: argparse.ArgumentParser, tokens: list[int]) -> None:
    """The MoE layer's shape and the run's settings, shared with scripts/profile_moe_layer.py."""
    p.add_argument("--tokens", type=int, nargs="+", default=tokens)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)


def start(args: argparse.Namespace) -> None:
    """Threads as asked, and the same random weights and routing each run."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)


def hf_experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, w_gate_up, w_down):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(num_experts=num_experts, hidden_size=hidden, moe_intermediate_size=inter)
    config._experts_implementation = "eager"  # the per-expert loop, not a kernel from the hub
    experts = Qwen3MoeExperts(config).to(dtype).eval()
    with torch.no_grad():
        experts.gate_up_proj.copy_(w_gate_up)
        experts.down_proj.copy_(w_down)
    return experts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_layer_args(p, tokens=[1, 4, 16, 64, 256, 1024])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    args = p.parse_args()
    start(args)
    rows = []
    print(f"{args.experts} experts of {args.intermediate}, hidden {args.hidden}, top-{args.top_k}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'dtype':<10}{'tokens':>7}{'active':>8}{'grouped ms':>12}{'packed ms':>11}{'native ms':>11}{'loop ms':>10}"
          f"{'loop/best':>11}{'MB read':>9}")
    for name in args.dtypes:
        dtype = DTYPES[name]
        w_gate_up = (0.02 * torch.randn(args.experts, 2 * args.intermediate, args.hidden)).to(dtype)
        w_down = (0.02 * torch.randn(args.experts, args.hidden, args.intermediate)).to(dtype)
        loop = hf_experts(args.experts, args.hidden, args.intermediate, dtype, w_gate_up, w_down)
        packed = PackedExperts(w_gate_up, w_down) if onednn_available() else None
        native = NativeExperts(w_gate_up, w_down) if NativeExperts.supports(dtype) else None
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden).to(dtype)
            weights, ids = torch.softmax(torch.randn(tokens, args.experts), -1).topk(args.top_k, dim=-1)
            weights = weights.to(dtype)
            with torch.no_grad():
                grouped_ms = median_ms(lambda: fused_experts(x, ids, weights, w_gate_up, w_down), args.repeats)
                packed_ms = None if packed is None else median_ms(lambda: fused_experts(
                    x, ids, weights, packed.gate_up, packed.down, linear=packed.linear), args.repeats)
                native_ms = None if native is None else median_ms(lambda: native(x, ids, weights), args.repeats)
                loop_ms = median_ms(lambda: loop(x, ids, weights), args.repeats)
            active = int(ids.unique().numel())
            mb = active * 3 * args.hidden * args.intermediate * w_down.element_size() / 1e6
            rows.append(dict(dtype=name, tokens=tokens, active_experts=active, grouped_ms=grouped_ms,
                             packed_ms=packed_ms, native_ms=native_ms, loop_ms=loop_ms, weight_mb=mb))
            best = min(ms for ms in (grouped_ms, packed_ms, native_ms) if ms is not None)
            packed_col, native_col = ("-" if ms is None else f"{ms:.3f}" for ms in (packed_ms, native_ms))
            print(f"{name:<10}{tokens:>7}{active:>8}{grouped_ms:>12.3f}{packed_col:>11}{native_col:>11}{loop_ms:>10.3f}"
                  f"{loop_ms / best:>10.2f}x{mb:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
