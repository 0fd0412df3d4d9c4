"""The ceilings a throughput run is held against, measured in the same process at its thread count,
and the work a run does, counted from its workload.

A run's achieved GEMM FLOP/s means little against a datasheet peak: what a CPU sustains depends on
the instruction set oneDNN picks for the dtype (AMX or AVX512-BF16 for bfloat16, AVX-512 FMA for
float32), the thread count and the load of a shared machine. So the peak is a GEMM through the same
prepacked oneDNN path the model's linears take, in the run's dtype and threads, and the bandwidth a
large copy at the same threads: both measured seconds before or after the run they judge.
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

# 512 tokens through a 2048x2048 layer: large enough that the packed GEMM runs at its peak, small
# enough to measure in a fraction of a second on one core.
PEAK_SHAPE = (512, 2048, 2048)
COPY_BYTES = 256 * 2**20  # well past any last-level cache, so the copy streams DRAM


@dataclass(frozen=True)
class Roofline:
    """GEMM peak (in `dtype`) and memory bandwidth at `num_threads`, measured here."""

    dtype: str
    num_threads: int
    gemm_peak_gflops: float
    memory_gbps: float


def median_ms(fn, repeats: int) -> float:
    """Median milliseconds per call of `fn` over `repeats` calls, after one warm-up call (kernel benchmarks)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _timed(fn, min_s: float, min_repeat: int = 3) -> float:
    """Seconds per call of `fn`, after one warm-up call, over at least `min_s` seconds."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls < min_repeat or time.perf_counter() - t0 < min_s:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def measure_gemm_peak(dtype: str, shape: tuple[int, int, int] = PEAK_SHAPE, min_s: float = 0.5) -> float:
    """GFLOP/s of an (m x k) @ (k x n) GEMM through the path the model's linears take in `dtype`: the prepacked
    oneDNN linear, or torch's F.linear where oneDNN does not run `dtype` here, at torch's current thread count."""
    import torch
    import torch.nn.functional as F

    from ecoserve.model.packed import PackedLinear, linear_packs

    m, k, n = shape
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(torch_dtype)
    w = torch.randn(n, k, generator=gen).to(torch_dtype)
    with torch.inference_mode():
        layer = PackedLinear(w, None) if linear_packs(torch_dtype) else (lambda t: F.linear(t, w))
        seconds = _timed(lambda: layer(x), min_s)
    return 2 * m * k * n / seconds / 1e9


def measure_memory_bandwidth(nbytes: int = COPY_BYTES, min_s: float = 0.5) -> float:
    """GB/s of a large tensor copy (bytes read plus bytes written) at torch's current thread count."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), min_s) / 1e9


@functools.cache
def measure(dtype: str, num_threads: int) -> Roofline:
    """Both ceilings at `num_threads` (torch's thread count is restored after), once per process."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        return Roofline(dtype, num_threads, measure_gemm_peak(dtype), _bandwidth(num_threads))
    finally:
        torch.set_num_threads(before)


@functools.cache
def _bandwidth(num_threads: int) -> float:
    """The copy bandwidth once per thread count (it does not depend on the dtype being judged)."""
    return measure_memory_bandwidth()


def linear_flops_per_token(config: dict) -> float:
    """FLOPs of one token through the decoder layers' linears (q, k, v, o, gate, up, down); in a
    mixture-of-experts layer the router's and the token's top-k experts' (and a shared expert's)."""
    from ecoserve.model.spec import ModelSpec

    h, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    attention = h * (heads * d + 2 * kv * d) + heads * d * h
    moe = ModelSpec.from_config(config).moe if config.get("architectures") else None
    if moe is None:
        return layers * 2 * (attention + 3 * h * inter)
    sparse_mlp = h * moe.num_experts + 3 * h * (moe.top_k * moe.intermediate_size + moe.shared_expert_intermediate_size)
    num_sparse = layers - len(moe.dense_layers)
    return 2 * (layers * attention + num_sparse * sparse_mlp + (layers - num_sparse) * 3 * h * inter)


def attention_flops_per_token(config: dict, context: float) -> float:
    """FLOPs of one query token's attention (QK^T and PV) over `context` tokens, all layers."""
    heads = config["num_attention_heads"]
    d = config.get("head_dim") or config["hidden_size"] // heads
    return config["num_hidden_layers"] * 4 * heads * d * context


@dataclass(frozen=True)
class Work:
    """What a workload asks of the machine: GEMM FLOPs and the bytes decode streams from memory."""

    gemm_flops: float  # the linears of every computed token, plus the LM head of every sampled one
    decode_kv_bytes: float  # K and V that decode attention reads: each decode step reads its whole context

    @classmethod
    def of(cls, config: dict, prompt_lens: list[int], output_lens: list[int], kv_bytes_per_token: int) -> "Work":
        computed = sum(prompt_lens) + sum(output_lens)
        lm_head = 2 * config["hidden_size"] * config["vocab_size"]
        # output token j >= 1 of a request comes from a decode step over prompt + j tokens of context
        contexts = sum((o - 1) * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
        return cls(computed * linear_flops_per_token(config) + sum(output_lens) * lm_head,
                   float(contexts * kv_bytes_per_token))


def weight_bytes_per_step(model) -> int:
    """Bytes of the weights every forward step reads whole: all but the embedding table (a step gathers
    a few rows of it, unless the LM head shares it) and the rotary tables."""
    from ecoserve.model.quant import weight_bytes

    def storages(module) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()] if not t.is_mkldnn}

    total = weight_bytes(model)
    lm_head = getattr(model, "lm_head", None)
    for name in ("embed_tokens", "rotary"):
        part = getattr(model, name, None)
        if part is not None and not (lm_head is not None and storages(part) & storages(lm_head)):
            total -= weight_bytes(part)
    return total
