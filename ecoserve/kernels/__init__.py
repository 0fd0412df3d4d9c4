"""Native CPU kernels, compiled on first use with torch.utils.cpp_extension.

Builds are cached under `$ECOSERVE_CACHE` (or `~/.cache/ecoserve`)/kernels, one folder per torch
version, instruction set and source file: they use `-march=native`, so a cache shared by machines
of different CPUs (a home directory on Ray nodes) must not hand one a binary built for another.
Ninja rebuilds a kernel when its source or the shared `simd.h` (the vector helpers and
exponentials the kernels share) changes.

The paged kernels check what they index before they read (bounds.h): shapes, context lengths
against the table width, and every block id a row reads against the cache, O(rows x blocks) per call
(0.3 us for 32 decodes of 256 tokens, against about 3-12 ms for a decode step of the tiny test model); a
bad table is a RuntimeError that names the row, column and value.

The engine works without them: if the compiler or ninja is missing, or ECOSERVE_NO_NATIVE=1,
`paged_decode()` and `paged_prefill()` return None and attention falls back to torch SDPA (over
gathered blocks for decodes), `fused_ops()` returns None and the layers run torch's elementwise
ops, `quant_matmul()` returns None and quantized layers dequantize with torch, `moe_experts()` returns
None and MoE layers run one oneDNN (or torch) GEMM pair per active expert, `lora_sgmv()` returns None
and LoRA modules run torch GEMMs per adapter slot, and `skinny_linear()` returns None and decode rows go
through oneDNN's GEMM like any others.

`ECOSERVE_CPU_ISA=avx2` or `avx512` (or the `isa` argument of the loaders) builds for a lower instruction
set than this CPU's into its own folder (kernels/cpu.py: the same switch lowers every kernel choice, oneDNN's
and ATen's): tests run the AVX2 paths on an AVX-512 machine with it. The attention kernels and fused ops take
bfloat16 rows on any build (the loads widen them with plain AVX2 or AVX-512F instructions), so a CPU without bf16
instructions runs them too.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

from ecoserve.cache_dir import cache_root
from ecoserve.kernels.cpu import ISA_ENV, LEVELS, apply_isa_limits, cpu_flags, isa_tag, lowered_flags, target_isa

__all__ = ["ISA_ENV", "cpu_flags", "distinct_builds", "isa_tag", "target_isa", "fused_ops", "lora_sgmv", "moe_experts",
           "paged_decode", "paged_prefill", "quant_matmul", "skinny_linear"]
apply_isa_limits()

logger = logging.getLogger(__name__)


_STALE_LOCK_S = 300  # a build holding its lock longer than this was killed: torch would wait forever


def _build_dir(source: str = "", isa: str = "native") -> Path:
    """One folder per torch version, instruction set and kernel source: ninja files of two extensions
    must not mix, and a binary built for one CPU must not load on another."""
    import torch

    tag = isa_tag() if isa == "native" else f"{isa_tag()}-as-{isa}"
    path = cache_root() / "kernels" / f"torch-{torch.__version__}" / tag / source
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        logger.warning("removing a stale kernel build lock left by a killed build: %s", lock)
        lock.unlink(missing_ok=True)
    return path


def _put_ninja_on_path() -> None:
    """torch finds ninja on PATH; the pip `ninja` package's binary is not there unless the venv is active."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


_FAST_MATH = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
# elementwise ops that must round as torch's do: no reassociation, no fused multiply-adds
_EXACT_MATH = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


@functools.lru_cache(maxsize=None)
def _load(source: str, what: str, exact: bool = False, isa: str = "native"):
    if os.environ.get("ECOSERVE_NO_NATIVE") == "1":
        return None
    lower = []
    if isa != "native":
        needs, lower = LEVELS[isa].needs, list(LEVELS[isa].compiler_flags)
        if not needs <= cpu_flags():  # a binary for an instruction set this CPU lacks would crash on load
            logger.warning("native CPU %s kernel for %s unavailable: this CPU lacks %s; using %s", source, isa,
                           " ".join(sorted(needs - cpu_flags())), what)
            return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        started = time.perf_counter()
        # one module name per instruction set: two builds of a source may be loaded in one process
        name = f"ecoserve_{source}" if isa == "native" else f"ecoserve_{source}_{isa}"
        module = load(name, [str(Path(__file__).with_name(f"{source}.cpp"))],
                      extra_cflags=(_EXACT_MATH if exact else _FAST_MATH) + lower,
                      build_directory=str(_build_dir(source, isa)), verbose=False)
        logger.debug("native %s kernel (%s) ready in %.1f s", source, isa, time.perf_counter() - started)
        return module
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("native CPU %s kernel unavailable (%s); using %s", source, str(e).splitlines()[0], what)
        return None


def _build_isa(isa: str | None) -> str:
    """The level to build for: `target_isa`, or native where this CPU has nothing above that level (the same
    binary: an AVX2-only machine lowered to avx2 reuses its native builds)."""
    isa = target_isa(isa)
    return "native" if isa != "native" and lowered_flags(cpu_flags(), isa) == cpu_flags() else isa


def distinct_builds(levels: tuple[str, ...] = ("native", "avx2")) -> list[str]:
    """The levels among `levels` whose builds differ here (the first of each): on an AVX2-only machine the
    avx2 build is the native one, so a test of both would run the same binary twice."""
    first: dict[str, str] = {}
    for level in levels:
        first.setdefault(_build_isa(level), level)
    return list(first.values())


def paged_decode(isa: str | None = None):
    """The compiled `paged_decode(q, k_cache, v_cache, tables, lens, scale)`, or None. q (and the
    result) and the cache are each float32 or bfloat16."""
    module = _load("paged_decode", "torch SDPA", isa=_build_isa(isa))
    return module.paged_decode if module is not None else None


def paged_prefill(isa: str | None = None):
    """The compiled `paged_prefill(q, k_cache, v_cache, out, tables, spans, scale)`, or None (also
    where the compiler targets neither AVX2 nor AVX-512). q and out share a dtype, float32 or
    bfloat16; the cache is either."""
    module = _load("paged_prefill", "torch SDPA", isa=_build_isa(isa))
    return module.paged_prefill if module is not None and module.has_simd() else None


def fused_ops(isa: str | None = None):
    """The compiled module with `rms_norm`, `head_rms_norm_`, `rotary_` and `silu_and_mul` (float32 or bfloat16
    rows) and `moe_route` (a router's top-k from its logits), or None."""
    return _load("fused_ops", "torch elementwise ops", exact=True, isa=_build_isa(isa))


def quant_matmul(isa: str | None = None):
    """The compiled module with `quant_linear(x, w, qtype)` and `dequantize(w, qtype, K)`, or None."""
    return _load("quant_matmul", "torch dequantization", isa=_build_isa(isa))


def moe_experts(isa: str | None = None):
    """The compiled module with `moe_experts(x, ids, weights, gate_up, down, inter, first)` (one MoE layer's
    routed experts in one call), `pack_experts(w)`, `unpack_experts(packed, N, K)` and `supports(dtype)`,
    or None. Its GEMMs are PyTorch's oneDNN brgemm micro-kernels, which pick the CPU's matrix unit at run
    time whatever `isa` the surrounding code is built for."""
    return _load("moe_experts", "the per-expert oneDNN GEMMs", exact=True, isa=_build_isa(isa))


def skinny_linear(isa: str | None = None):
    """The compiled module with `fit(packed, weight)` (the layout of oneDNN's prepacked weight, or zeros) and
    `skinny_linear(x, packed, bias, N, NB, V, Kp)` (a few rows times that weight), or None."""
    return _load("skinny_linear", "oneDNN's GEMM for decode rows", isa=_build_isa(isa))


def lora_sgmv(isa: str | None = None):
    """The compiled `lora_sgmv_(y, x, a, b, rows, bounds, slots, widths)` (every adapter segment of a step in one
    call, through torch's cpublas micro-kernels), or None."""
    module = _load("lora_sgmv", "torch GEMMs per adapter slot", isa=_build_isa(isa))
    return module.lora_sgmv_ if module is not None else None
