"""`--profile` for the benchmarks: where the CPU time of a run goes.

Two passes over the same callable, because each profiler distorts what the other measures:
torch.profiler attributes the self time of aten ops to categories (matmuls, attention, the
elementwise chains, tensor bookkeeping, sampling); cProfile gives the Python functions and the
native kernels (pybind calls such as the quantized matmul and paged decode, which torch.profiler
does not see). The profiler's op times are wall-clock intervals of the calling thread, so shares are
of the profiled pass's wall time; what no aten op accounts for is Python plus native kernels (and,
at several threads on a busy machine, waiting for the other threads).
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable

_CATEGORIES = {
    "matmul (aten mm/addmm)": {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"},
    "attention (SDPA, KV-cache writes)": {"aten::_scaled_dot_product_flash_attention_for_cpu",
                                          "aten::_scaled_dot_product_attention_math", "aten::_softmax",
                                          "aten::index_copy_", "aten::_index_put_impl_", "aten::index"},
    "elementwise (RMSNorm, rotary, SiLU-mul, residual)": {
        "aten::mul", "aten::add", "aten::sub", "aten::div", "aten::div_", "aten::pow", "aten::mean", "aten::rsqrt",
        "aten::silu", "aten::neg", "aten::cat", "aten::copy_", "aten::_to_copy", "aten::sum", "aten::mul_",
        "aten::add_", "aten::embedding", "aten::index_select", "aten::clone", "aten::fill_", "aten::zero_"},
    "sampling": {"aten::argmax", "aten::topk", "aten::sort", "aten::multinomial", "aten::max", "aten::softmax",
                 "aten::log_softmax", "aten::cumsum", "aten::gather", "aten::exponential_"},
}


def torch_breakdown(run: Callable[[], object], units: int, unit: str) -> str:
    """Wall ms per `unit` by category of aten op, plus what no aten op accounts for."""
    from torch.profiler import ProfilerActivity, profile

    wall0, cpu0 = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    per_cat: dict[str, float] = {}
    in_aten = 0.0
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        in_aten += seconds
        cat = next((c for c, names in _CATEGORIES.items() if event.key in names), "tensor bookkeeping and other aten")
        per_cat[cat] = per_cat.get(cat, 0.0) + seconds
    per_cat["Python and native kernels (not aten)"] = max(wall - in_aten, 0.0)
    lines = [f"torch.profiler: {1000 * wall / units:.2f} ms wall, {1000 * cpu / units:.2f} ms process CPU per "
             f"{unit} ({units} {unit}s, profiler overhead included)"]
    for cat, seconds in sorted(per_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {cat:<52}{1000 * seconds / units:>8.2f} ms {100 * seconds / wall:>5.1f}%")
    return "\n".join(lines)


def cprofile_top(run: Callable[[], object], limit: int = 15) -> str:
    """The functions (Python and native) with the most own time under cProfile."""
    prof = cProfile.Profile()
    prof.runcall(run)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(limit)
    body = out.getvalue()
    return "cProfile (own time):\n" + body[body.find("   ncalls"):].rstrip()


def report(run: Callable[[], object], units: int, unit: str) -> str:
    return torch_breakdown(run, units, unit) + "\n" + cprofile_top(run)
