"""Native CPU kernels, compiled on first use with torch.utils.cpp_extension (cached per machine).

The engine works without them: if the compiler or ninja is missing, or ECOSERVE_NO_NATIVE=1,
`paged_decode()` returns None and attention falls back to torch SDPA over gathered blocks.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _load():
    if os.environ.get("ECOSERVE_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        started = time.perf_counter()
        module = load("ecoserve_paged_decode", [str(Path(__file__).with_name("paged_decode.cpp"))],
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"], verbose=False)
        logger.debug("native paged decode kernel ready in %.1f s", time.perf_counter() - started)
        return module
    except Exception as e:  # no compiler, no ninja, a build error: the SDPA path still works
        logger.warning("native CPU attention kernel unavailable (%s); using torch SDPA", str(e).splitlines()[0])
        return None


def paged_decode():
    """The compiled `paged_decode(q, k_cache, v_cache, tables, lens, scale)`, or None."""
    module = _load()
    return module.paged_decode if module is not None else None
