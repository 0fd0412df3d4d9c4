"""Which path each CPU op takes here: one decision per op, from the capability probe (kernels/cpu.py).

The layers ask these functions (never the CPU's flags), and `ecoserve env` prints `kernel_table()`, the
same decisions as a table, as `python -m torch.utils.collect_env` and `vllm collect-env` print theirs.
Each function takes the capabilities to decide for (tests describe other CPUs); by default this process's.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from ecoserve import kernels
from ecoserve.kernels import cpu
from ecoserve.kernels.cpu import CpuCapabilities

_FLOAT = (torch.float32, torch.bfloat16)


def _caps(caps: CpuCapabilities | None) -> CpuCapabilities:
    return cpu.capabilities() if caps is None else caps


def onednn_available(caps: CpuCapabilities | None = None) -> bool:
    """torch has oneDNN and it is enabled: float linears are prepacked for it, and W8A8 may use its int8 GEMM."""
    return _caps(caps).onednn


def onednn_linear(dtype: torch.dtype, caps: CpuCapabilities | None = None) -> bool:
    """Float linears of `dtype` run oneDNN on a prepacked weight (else torch's `F.linear`): float32 wherever
    oneDNN is, bfloat16 only where oneDNN runs it natively (elsewhere it would refuse or emulate it)."""
    caps = _caps(caps)
    return caps.onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and caps.onednn_bf16))


def packable_dtypes(caps: CpuCapabilities | None = None) -> frozenset[torch.dtype]:
    """The float dtypes whose linears are prepacked for oneDNN here."""
    return frozenset(d for d in _FLOAT if onednn_linear(d, caps))


def bf16_linear_widened(caps: CpuCapabilities | None = None) -> bool:
    """bfloat16 linears run oneDNN's float32 GEMM on the weight widened once (exactly) to float32, the input
    widened and the output rounded to bf16 (a bf16 GEMM's float32 accumulation, at float32's speed): where
    oneDNN has no native bf16, torch's `F.linear` emulates bf16 at a sixth of float32's speed (AVX2 EPYC, one
    thread, 64x768 @ 768x2048: 24 against 4.0 ms). The weights then take float32's memory."""
    caps = _caps(caps)
    return caps.onednn and not caps.onednn_bf16


def w8a8_onednn(caps: CpuCapabilities | None = None) -> bool:
    """W8A8's int8 GEMM runs oneDNN's prepacked int8 matmul (else `torch._int_mm` on the plain int8 weight).
    Only with int8 dot-product instructions (VNNI, AMX-INT8): without them oneDNN's x86 int8 kernels sum
    pairs of u8 x s8 products in int16 (vpmaddubsw), which saturates, and the outputs are wrong by up to
    ~14%; `torch._int_mm` widens to int32 and is exact on every CPU."""
    caps = _caps(caps)
    return caps.onednn and caps.int8_dot


def bf16_is_fast(caps: CpuCapabilities | None = None) -> bool:
    """bfloat16 GEMMs beat float32's here (bf16 dot products in hardware): `--dtype auto` picks bfloat16 for a
    half checkpoint only then."""
    return _caps(caps).bf16_dot


def sdpa_prefill_is_faster(cache_dtype: torch.dtype, caps: CpuCapabilities | None = None) -> bool:
    """Prompt chunks over a bf16 cache go faster through torch SDPA than the native kernel: on a CPU with
    AMX-BF16 torch's flash attention runs its bf16 products on the matrix unit, which measured 1.6-2.3x the
    native kernel's float32 multiply-adds for prompts of 256-1024 tokens (equal at 64; one core, 12 heads over
    4 kv heads of 64). Decodes stay native: they are memory-bound, and SDPA would first gather their blocks."""
    return cache_dtype == torch.bfloat16 and _caps(caps).amx_bf16


def native_lora(dtype: torch.dtype, caps: CpuCapabilities | None = None) -> bool:
    """LoRA's all-segments kernel may run `dtype` here (it also needs to build): torch's cpublas micro-kernels
    need oneDNN and AVX2, and bfloat16 the pair-interleaved layout AMX's micro-kernels read."""
    caps = _caps(caps)
    if not (caps.onednn and caps.avx2) or dtype not in _FLOAT:
        return False
    return dtype == torch.float32 or caps.amx_bf16


def native_experts(dtype: torch.dtype) -> bool:
    """The native grouped MoE kernel builds here and runs `dtype` through brgemm (bfloat16 needs AMX's packed
    layout, which PyTorch's `cpublas::could_pack` reports under oneDNN's ISA limit)."""
    if dtype == torch.bfloat16 and not cpu.capabilities().amx_bf16:
        return False  # also where oneDNN's own ISA limit was fixed before ECOSERVE_CPU_ISA could lower it
    kernel = kernels.moe_experts()
    return kernel is not None and dtype in _FLOAT and kernel.supports(dtype)


@dataclass(frozen=True)
class KernelPath:
    """One row of the table: an op at a dtype, the path it takes here, and why."""

    op: str
    dtype: str
    path: str
    why: str


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kernel_table(caps: CpuCapabilities | None = None) -> list[KernelPath]:
    """Every op's path at each dtype, as the engine chooses it in this process (native kernels are built
    on first use, so the first call may compile them)."""
    caps = _caps(caps)
    rows: list[KernelPath] = []
    decode_rows = kernels.skinny_linear()
    for dtype in _FLOAT:
        packed = onednn_linear(dtype, caps)
        widened = dtype == torch.bfloat16 and bf16_linear_widened(caps)
        rows.append(KernelPath("linear", _name(dtype), "oneDNN prepacked" if packed else "oneDNN float32, widened"
                               if widened else "torch F.linear", "weight reordered once" if packed
                               else "oneDNN has no native bf16 here" if widened else "torch without oneDNN"))
        packed = packed or widened
        streamed = packed and decode_rows is not None
        stream_rows = decode_rows.max_rows(torch.float32 if widened else dtype) if streamed else 0
        rows.append(KernelPath("linear, decode rows", _name(dtype),
                               f"native stream (<= {stream_rows} rows)" if streamed else "as linear",
                               "over oneDNN's packed weight" if streamed else "kernel unavailable" if packed
                               else "not prepacked"))
    quant = kernels.quant_matmul()
    if w8a8_onednn(caps):
        w8a8 = "oneDNN int8 prepacked"
    else:
        w8a8 = "native int8_gemm (sign trick)" if quant else "torch._int_mm"
    rows.append(KernelPath("w8a8 GEMM", "int8", w8a8, "int8 dot products in hardware" if w8a8_onednn(caps)
                           else "no VNNI/AMX-INT8: oneDNN's int16 pair sums would saturate" if caps.onednn
                           else "torch without oneDNN"))
    rows.append(KernelPath("GGUF / Q8_0 matmul", "float32", f"native {quant.isa()}" if quant else "torch dequantize",
                           "integer dot products of the quantized blocks" if quant else "kernel unavailable"))
    decode, prefill = kernels.paged_decode(), kernels.paged_prefill()
    for dtype in _FLOAT:
        rows.append(KernelPath("attention, decode", _name(dtype), "native paged" if decode else "torch SDPA",
                               "over the paged cache" if decode else "kernel unavailable (gathers blocks)"))
        sdpa = prefill is None or sdpa_prefill_is_faster(dtype, caps)
        rows.append(KernelPath("attention, prompt chunks", _name(dtype), "torch SDPA" if sdpa else "native paged",
                               "AMX-BF16 flash attention" if prefill is not None and sdpa
                               else "kernel unavailable" if sdpa else "over the paged cache"))
    fused = kernels.fused_ops()
    rows.append(KernelPath("norms, rotary, SiLU", "both", "native fused" if fused else "torch elementwise",
                           "one pass, torch's rounding" if fused else "kernel unavailable"))
    for dtype in _FLOAT:
        if native_experts(dtype):
            path, why = "native grouped brgemm", "one call per layer"
        elif dtype == torch.bfloat16 and onednn_linear(dtype, caps):
            path, why = "oneDNN per expert", "no brgemm micro-kernel for bf16 here"
        elif dtype == torch.bfloat16:
            path, why = "torch per expert", "neither brgemm nor oneDNN runs bf16 here"
        else:
            path, why = "torch per expert", "kernel unavailable; oneDNN per expert with --cpu-linear onednn"
        rows.append(KernelPath("MoE experts", _name(dtype), path, why))
    for dtype in _FLOAT:
        native = native_lora(dtype, caps) and kernels.lora_sgmv() is not None
        rows.append(KernelPath("LoRA SGMV", _name(dtype), "native all-segments" if native else "torch per slot",
                               "cpublas micro-kernels" if native else "needs AMX-BF16" if dtype == torch.bfloat16
                               else "needs oneDNN and AVX2"))
    rows.append(KernelPath("--dtype auto, half checkpoint", "", "bfloat16" if bf16_is_fast(caps) else "float32",
                           "bf16 dot products in hardware" if bf16_is_fast(caps)
                           else "no AVX512-BF16/AMX-BF16: bf16 would widen to float32 GEMMs"))
    return rows


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_report(caps: CpuCapabilities | None = None) -> str:
    """`ecoserve env`: the machine, the capabilities in force and the kernel table, as text."""
    import os

    caps = _caps(caps)
    lines = [f"ecoserve environment", f"  CPU                {_cpu_model()} ({os.cpu_count()} logical CPUs)",
             f"  instruction level  {caps.level} ({kernels.ISA_ENV}={os.environ.get(kernels.ISA_ENV, '')})",
             f"  vector features    {caps.instruction_sets()}",
             f"  torch              {torch.__version__}, ATen CPU capability {caps.aten_capability}, "
             f"{torch.get_num_threads()} threads",
             f"  oneDNN             {'yes' if caps.onednn else 'no'} (bf16 {'yes' if caps.onednn_bf16 else 'no'}; "
             f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '')})",
             f"  native kernels     built for {kernels.target_isa()} ({kernels.isa_tag()})", ""]
    table = kernel_table(caps)
    widths = [max(len(getattr(r, f)) for r in table) for f in ("op", "dtype", "path")]
    lines.append(f"{'op':<{widths[0]}}  {'dtype':<{widths[1]}}  {'path':<{widths[2]}}  why")
    for r in table:
        lines.append(f"{r.op:<{widths[0]}}  {r.dtype:<{widths[1]}}  {r.path:<{widths[2]}}  {r.why}")
    return "\n".join(lines)
