"""`--profile` for the benchmarks: where the time of a run goes, and how close it runs to the machine.

Two profiled passes over the same work, because each profiler distorts what the other measures:
torch.profiler attributes the self time of dispatcher ops (aten, oneDNN's prepacked linears) to
categories; cProfile sees the native kernels (pybind calls such as paged decode, the fused
elementwise ops and the quantized matmul, which torch.profiler does not) and the Python functions.
Both overheads fall on the Python side, not inside the ops, so the ops' seconds are taken as they
are and set against the un-profiled run's wall time: what no op accounts for is Python, the
scheduler and the rest (and, at several threads on a busy machine, waiting for the other threads).
The achieved GEMM FLOP/s and streamed bytes are set against a GEMM peak and a copy bandwidth
measured in the same process at the same dtype and threads (`roofline.py`).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ecoserve.bench.roofline import Roofline, Work

GEMM = "GEMM (linears)"
ATTENTION = "attention"
ELEMENTWISE = "elementwise (norm, rotary, SiLU-mul, copies)"
SAMPLING = "sampling"
REST = "Python and the rest"
CATEGORIES = (GEMM, ATTENTION, ELEMENTWISE, SAMPLING, REST)

_OPS = {
    GEMM: {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_int_mm",
           "aten::_weight_int8pack_mm"},
    ATTENTION: {"aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                "aten::_softmax", "aten::index_copy_", "aten::_index_put_impl_", "aten::index"},
    ELEMENTWISE: {"aten::mul", "aten::add", "aten::sub", "aten::div", "aten::div_", "aten::pow", "aten::mean",
                  "aten::rsqrt", "aten::silu", "aten::neg", "aten::cat", "aten::copy_", "aten::_to_copy", "aten::sum",
                  "aten::mul_", "aten::add_", "aten::embedding", "aten::index_select", "aten::clone", "aten::fill_",
                  "aten::zero_"},
    SAMPLING: {"aten::argmax", "aten::topk", "aten::sort", "aten::multinomial", "aten::max", "aten::softmax",
               "aten::log_softmax", "aten::cumsum", "aten::gather", "aten::exponential_"},
}
_GEMM_NAMESPACES = ("mkldnn::_linear", "onednn::qlinear", "mkldnn::_mkl_linear")  # prepacked and int8 linears
# the native kernels' pybind entry points (ecoserve/kernels), as cProfile names them
_NATIVE = {"paged_decode": ATTENTION, "paged_prefill": ATTENTION, "rms_norm": ELEMENTWISE, "rotary_": ELEMENTWISE,
           "head_rms_norm_": ELEMENTWISE, "silu_and_mul": ELEMENTWISE, "quant_linear": GEMM, "dequantize": GEMM,
           "skinny_linear": GEMM, "moe_experts": GEMM, "lora_sgmv_": GEMM, "moe_route": ELEMENTWISE,
           "quantize_per_token": GEMM, "scale_rows_to": GEMM, "int8_gemm": GEMM}
_BUILTIN = re.compile(r"built-in method ((?:\w+\.)*)(\w+)")
# vLLM's CPU build (`--compare vllm --profile`): its custom ops, and the self time of the inductor-compiled graph
# of everything else in its forward (norms, rotary, SiLU-mul and residual adds fused by torch.compile)
_PEER_OPS = {"_C::onednn_mm": GEMM, "_C::onednn_scaled_mm": GEMM, "_C::cpu_attention_with_kv_cache": ATTENTION,
             "_C::cpu_attn_reshape_and_cache": ATTENTION, "vllm::unified_attention_with_output": ATTENTION,
             "vllm::unified_kv_cache_update": ATTENTION, "_C::greedy_argmax": SAMPLING}
_COMPILED_GRAPH = "## Call CompiledFxGraph"


def op_category(op: str) -> str:
    """The category of a torch.profiler op name; ops of no category (views, allocation) count as the rest."""
    if op.startswith(_GEMM_NAMESPACES):
        return GEMM
    if op.startswith("ecoserve::"):  # a native kernel registered as a dispatcher op
        return _NATIVE.get(op.removeprefix("ecoserve::"), REST)
    if op in _PEER_OPS:
        return _PEER_OPS[op]
    if op.startswith(_COMPILED_GRAPH):
        return ELEMENTWISE
    return next((c for c, names in _OPS.items() if op in names), REST)


@dataclass
class Breakdown:
    """Where one run's wall time went, by category, and its GEMM and memory figures against the roofline."""

    label: str
    elapsed_s: float  # the un-profiled run's wall time
    seconds: dict[str, float]  # every category of CATEGORIES; sums to elapsed_s unless the ops overran it
    steps: int  # forward passes of the model
    work: Work
    weight_bytes_per_step: int
    roofline: Roofline
    shares: dict[str, float] = field(init=False)

    def __post_init__(self) -> None:
        total = sum(self.seconds.values())
        self.shares = {c: self.seconds[c] / total for c in CATEGORIES}

    @property
    def streamed_bytes(self) -> float:
        return self.steps * self.weight_bytes_per_step + self.work.decode_kv_bytes

    @property
    def gemm_gflops(self) -> float:
        """FLOP/s while the linears run: the run's GEMM FLOPs over the seconds spent in GEMM ops."""
        return self.work.gemm_flops / max(self.seconds[GEMM], 1e-9) / 1e9

    @property
    def gemm_peak_fraction(self) -> float:
        return self.gemm_gflops / self.roofline.gemm_peak_gflops

    @property
    def memory_gbps(self) -> float:
        """Bytes streamed (weights once per step, K/V of every decode) over the run's wall time."""
        return self.streamed_bytes / self.elapsed_s / 1e9

    @property
    def memory_fraction(self) -> float:
        return self.memory_gbps / self.roofline.memory_gbps

    def to_dict(self) -> dict:
        return {**asdict(self), "streamed_bytes": self.streamed_bytes, "gemm_gflops": self.gemm_gflops,
                "gemm_peak_fraction": self.gemm_peak_fraction, "memory_gbps": self.memory_gbps,
                "memory_fraction": self.memory_fraction}

    def summary(self) -> str:
        r, gb, work = self.roofline, 1e9, self.work
        return "\n".join([
            f"{self.label}: GEMM {work.gemm_flops / gb:.0f} GFLOP in {self.seconds[GEMM]:.1f} s = "
            f"{self.gemm_gflops:.1f} GFLOP/s, {100 * self.gemm_peak_fraction:.0f}% of the {r.dtype} packed-GEMM peak "
            f"{r.gemm_peak_gflops:.1f} GFLOP/s at {r.num_threads} thread(s)",
            f"{self.label}: memory {self.streamed_bytes / gb:.1f} GB streamed (weights "
            f"{self.weight_bytes_per_step / gb:.3f} GB x {self.steps} steps, decode K/V {work.decode_kv_bytes / gb:.1f}"
            f" GB) in {self.elapsed_s:.1f} s = {self.memory_gbps:.2f} GB/s, {100 * self.memory_fraction:.0f}% of the "
            f"copy bandwidth {r.memory_gbps:.1f} GB/s"])


def side_by_side(breakdowns: list[Breakdown]) -> str:
    """One column per run (e.g. per precision): seconds and share of each category, then the roofline lines."""
    width = max(14, *(len(b.label) + 2 for b in breakdowns))
    lines = [f"{'where the time goes':<46}" + "".join(f"{b.label:>{width}}" for b in breakdowns)]
    for c in CATEGORIES:
        lines.append(f"  {c:<44}" + "".join(f"{f'{b.seconds[c]:.2f} s {100 * b.shares[c]:.0f}%':>{width}}"
                                             for b in breakdowns))
    lines.append(f"  {'run (un-profiled wall time)':<44}" + "".join(f"{f'{b.elapsed_s:.2f} s':>{width}}"
                                                                      for b in breakdowns))
    return "\n".join(lines + [b.summary() for b in breakdowns])


def peer_breakdown(label: str, elapsed_s: float, op_seconds: dict[str, float], top: int = 8) -> tuple[dict, str]:
    """A peer's profiled pass (self seconds per op) by category, against its un-profiled wall time as ours is
    (what no op accounts for is the rest), and its top ops: the JSON entry and the printed table."""
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for op, s in op_seconds.items():
        seconds[op_category(op)] += s
    seconds[REST] = max(elapsed_s - sum(v for c, v in seconds.items() if c != REST), 0.0)
    lines = [f"where the time goes: {label} (torch.profiler self time of a second pass; the rest: its un-profiled "
             f"wall time {elapsed_s:.2f} s less the ops)"]
    lines += [f"  {c:<44}{seconds[c]:>8.2f} s {100 * seconds[c] / max(elapsed_s, 1e-9):>3.0f}%" for c in CATEGORIES]
    ranked = sorted(op_seconds.items(), key=lambda kv: -kv[1])[:top]
    lines += ["  top ops: " + ", ".join(f"{op} {s:.2f} s" for op, s in ranked)]
    return {"seconds": seconds, "top_ops": dict(ranked)}, "\n".join(lines)


def op_seconds(run: Callable[[], object]) -> dict[str, float]:
    """Self seconds of the dispatcher ops in one profiled pass of `run`, by category."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    for event in prof.key_averages():
        seconds[op_category(event.key)] += event.self_cpu_time_total / 1e6
    return seconds


def python_pass(run: Callable[[], object], limit: int = 15) -> tuple[dict[str, float], str]:
    """One cProfile pass: the native kernels' seconds by category, and the top functions by own time."""
    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof)
    native = dict.fromkeys(CATEGORIES, 0.0)
    for (_, _, name), (_, _, own_s, _, _) in stats.stats.items():
        m = _BUILTIN.search(name)
        # a pybind entry point; torch.ops calls are dispatcher ops that torch.profiler has counted already
        if m and m.group(2) in _NATIVE and not m.group(1).startswith("torch."):
            native[_NATIVE[m.group(2)]] += own_s
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(limit)
    body = out.getvalue()
    return native, "cProfile (own time):\n" + body[body.find("   ncalls"):].rstrip()


def profile_run(run: Callable[[], object], *, label: str, elapsed_s: float, model, work: Work,
                weight_bytes_per_step: int, roofline: Roofline) -> tuple[Breakdown, str]:
    """Profile two passes of `run` (the same work as the timed run of `elapsed_s` seconds, without prefix-cache
    hits) on `model`; returns the breakdown and cProfile's top functions."""
    steps = 0

    def count(*_):
        nonlocal steps
        steps += 1

    hook = model.register_forward_pre_hook(count)
    try:
        ops = op_seconds(run)
    finally:
        hook.remove()
    native, top = python_pass(run)
    seconds = {c: ops[c] + native[c] for c in CATEGORIES if c != REST}
    seconds[REST] = max(elapsed_s - sum(seconds.values()), 0.0)
    return Breakdown(label, elapsed_s, seconds, steps, work, weight_bytes_per_step, roofline), top


def torch_breakdown(run: Callable[[], object], units: int, unit: str) -> str:
    """Per `unit` (a decoded token, a step): wall ms by category over one profiled pass, with the native
    kernels' time from a cProfile pass; the rest is the profiled pass's wall time no op accounts for."""
    return _per_unit(run, units, unit)[0]


def _per_unit(run: Callable[[], object], units: int, unit: str) -> tuple[str, str]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    ops = op_seconds(run)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    native, top = python_pass(run)
    seconds = {c: ops[c] + native[c] for c in CATEGORIES if c != REST}
    seconds[REST] = max(wall - sum(seconds.values()), 0.0)
    lines = [f"torch.profiler: {1000 * wall / units:.2f} ms wall, {1000 * cpu / units:.2f} ms process CPU per "
             f"{unit} ({units} {unit}s, profiler overhead included)"]
    for c, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {c:<52}{1000 * s / units:>8.2f} ms {100 * s / max(wall, 1e-9):>5.1f}%")
    return "\n".join(lines), top


def cprofile_top(run: Callable[[], object], limit: int = 15) -> str:
    """The functions (Python and native) with the most own time under cProfile."""
    return python_pass(run, limit)[1]


def report(run: Callable[[], object], units: int, unit: str) -> str:
    """The per-unit breakdown and cProfile's top functions, from one pass of each profiler."""
    return "\n".join(_per_unit(run, units, unit))
