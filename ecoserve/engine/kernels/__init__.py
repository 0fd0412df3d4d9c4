"""Native CPU kernels, compiled on first use with torch.utils.cpp_extension.

Builds are cached under `$ECOSERVE_CACHE` (or `~/.cache/ecoserve`)/kernels, one folder per torch
version and source file; ninja rebuilds one when its source or the shared `simd.h` (the vector
helpers and exponentials the kernels share) changes.

The engine works without them: if the compiler or ninja is missing, or ECOSERVE_NO_NATIVE=1,
`paged_decode()` and `paged_prefill()` return None and attention falls back to torch SDPA (over
gathered blocks for decodes), `fused_ops()` returns None and the layers run torch's elementwise
ops, and `quant_matmul()` returns None and quantized layers dequantize with torch.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)


_STALE_LOCK_S = 300  # a build holding its lock longer than this was killed: torch would wait forever


def _build_dir(source: str = "") -> Path:
    """One folder per torch version and kernel source: ninja files of two extensions must not mix."""
    import torch

    from ecoserve.model.gguf import cache_root

    path = cache_root() / "kernels" / f"torch-{torch.__version__}" / source
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
def _load(source: str, what: str, exact: bool = False):
    if os.environ.get("ECOSERVE_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        started = time.perf_counter()
        module = load(f"ecoserve_{source}", [str(Path(__file__).with_name(f"{source}.cpp"))],
                      extra_cflags=_EXACT_MATH if exact else _FAST_MATH,
                      build_directory=str(_build_dir(source)), verbose=False)
        logger.debug("native %s kernel ready in %.1f s", source, time.perf_counter() - started)
        return module
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("native CPU %s kernel unavailable (%s); using %s", source, str(e).splitlines()[0], what)
        return None


def paged_decode():
    """The compiled `paged_decode(q, k_cache, v_cache, tables, lens, scale)`, or None."""
    module = _load("paged_decode", "torch SDPA")
    return module.paged_decode if module is not None else None


def paged_prefill():
    """The compiled `paged_prefill(q, k_cache, v_cache, out, tables, spans, scale)`, or None (also
    where the compiler targets neither AVX2 nor AVX-512)."""
    module = _load("paged_prefill", "torch SDPA")
    return module.paged_prefill if module is not None and module.has_simd() else None


def fused_ops():
    """The compiled module with `rms_norm`, `rotary_` and `silu_and_mul`, or None."""
    return _load("fused_ops", "torch elementwise ops", exact=True)


def quant_matmul():
    """The compiled module with `quant_linear(x, w, qtype)` and `dequantize(w, qtype, K)`, or None."""
    return _load("quant_matmul", "torch dequantization")
