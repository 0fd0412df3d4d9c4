"""The CPU capability probe: the one place that reads what this CPU, oneDNN and torch can run.

Every kernel choice asks `capabilities()` (directly or through `ecoserve.kernels.paths`), never
/proc/cpuinfo or torch's own checks: so one switch, `ECOSERVE_CPU_ISA`, can lower what the whole engine
believes the CPU has, and an AVX-512 or AMX machine can run the paths an AVX2-only one takes.

`ECOSERVE_CPU_ISA=avx2` (or `avx512`: AVX-512 F/BW/VL/DQ without VNNI, BF16, FP16 or AMX, a Skylake-SP)
hides every flag above that level from the probe, builds the native kernels for it (their own cache
folder) and, on import, sets oneDNN's `ONEDNN_MAX_CPU_ISA` and ATen's `ATEN_CPU_CAPABILITY` to the same
level unless they are set already. oneDNN and ATen read those once, at their first kernel: a process
that has already run a GEMM keeps the level it started with, so CI sets all three in the environment.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

ISA_ENV = "ECOSERVE_CPU_ISA"

# instruction sets the probe can lower to, from a CPU that has more
_AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# flags of instructions above plain AVX2 + FMA (x86 names as /proc/cpuinfo spells them)
_ABOVE_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")
_AVX512_CORE_KEEPS = _AVX512_CORE | {"avx512cd"}


@dataclass(frozen=True)
class IsaLevel:
    """A lower instruction set: what the CPU needs for it, the compiler flags after -march=native, and
    the level oneDNN and ATen take for it."""

    name: str
    needs: frozenset[str]
    compiler_flags: tuple[str, ...]
    onednn: str
    aten: str

    def keeps(self, flag: str) -> bool:
        if not flag.startswith(_ABOVE_AVX2):
            return True
        return self.name == "avx512" and flag in _AVX512_CORE_KEEPS


_NO_AVX512_EXTENSIONS = ("-mno-avx512vnni", "-mno-avx512bf16", "-mno-avx512fp16", "-mno-avx512ifma",
                         "-mno-avx512vbmi", "-mno-avx512vbmi2", "-mno-avx512bitalg", "-mno-avx512vpopcntdq")
_NO_AVX_VNNI_AMX = ("-mno-avxvnni", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
LEVELS = {
    # -mno-avx512f turns off every AVX-512 extension with it
    "avx2": IsaLevel("avx2", frozenset({"avx2", "fma"}), ("-mno-avx512f", *_NO_AVX_VNNI_AMX), "AVX2", "avx2"),
    "avx512": IsaLevel("avx512", _AVX512_CORE | {"avx2", "fma"}, (*_NO_AVX512_EXTENSIONS, *_NO_AVX_VNNI_AMX),
                       "AVX512_CORE", "avx512"),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, Arm `Features`); empty elsewhere. The raw
    reading: kernel choices use `capabilities().flags`, which `ECOSERVE_CPU_ISA` may lower."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def target_isa(isa: str | None = None) -> str:
    """The instruction set to build and choose kernels for: `isa`, else $ECOSERVE_CPU_ISA, else `native`."""
    isa = (isa or os.environ.get(ISA_ENV) or "native").lower()
    if isa != "native" and isa not in LEVELS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected native or one of {sorted(LEVELS)}")
    return isa


def lowered_flags(flags: frozenset[str], isa: str) -> frozenset[str]:
    """`flags` as a CPU of level `isa` would list them (the flags above it removed); `native` keeps all."""
    if isa == "native":
        return flags
    return frozenset(f for f in flags if LEVELS[isa].keeps(f))


# the features that name a build; the digest of every instruction-set flag tells the rest apart
_NAMED_FEATURES = {"avx512_bf16": "bf16", "avx512_vnni": "vnni", "avx_vnni": "avxvnni", "avx512_fp16": "fp16",
                   "amx_tile": "amx"}
_ISA_PREFIXES = ("avx", "amx", "sse", "ssse", "fma", "f16c", "bmi", "adx", "abm", "lzcnt", "popcnt", "movbe",
                 "aes", "vaes", "pclmul", "vpclmul", "gfni", "sha", "neon", "asimd", "sve", "fp", "i8mm", "bf16")


def isa_tag() -> str:
    """A short name of the instruction set a `-march=native` build targets here, e.g.
    `avx512-bf16-vnni-1a2b3c4d`: the vector width, the features the kernels use by name, and a
    digest of every instruction-set flag (the compiler may use any of them)."""
    flags = cpu_flags()
    if not flags:  # no /proc/cpuinfo: torch's view of the vector unit is the best there is
        import torch

        return f"{platform.machine().lower()}-{torch.backends.cpu.get_cpu_capability().lower()}"
    width = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else platform.machine().lower()
    named = [name for flag, name in _NAMED_FEATURES.items() if flag in flags]
    isa = sorted(f for f in flags if f.startswith(_ISA_PREFIXES))
    digest = hashlib.sha1(" ".join(isa).encode()).hexdigest()[:8]
    return "-".join([width, *named, digest])


# the int8 dot-product instructions (u8 x s8 summed in int32); without them x86 int8 GEMMs sum pairs of
# products in int16 (vpmaddubsw), which saturates
INT8_DOT_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")
# the bfloat16 dot-product instructions that make bf16 GEMMs faster than float32's
BF16_DOT_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class CpuCapabilities:
    """What kernels this process may choose: the CPU's flags at the level in force and what oneDNN and ATen run."""

    level: str = "native"  # ECOSERVE_CPU_ISA: native, or the lower level the probe reports
    flags: frozenset[str] = field(default_factory=frozenset)  # at that level
    onednn: bool = False  # torch has oneDNN (mkldnn) and it is enabled
    onednn_bf16: bool = False  # oneDNN runs bfloat16 GEMMs here (AVX-512 BW/VL/DQ or AVX-NE-CONVERT at least)
    aten_capability: str = ""  # the vector level of torch's own CPU kernels (`torch.backends.cpu`)

    @classmethod
    def from_flags(cls, flags: frozenset[str] | set[str], onednn: bool = True, level: str = "native",
                   aten_capability: str = "") -> CpuCapabilities:
        """The capabilities of a CPU with these flags (tests describe other CPUs with it)."""
        flags = frozenset(flags)
        bf16 = onednn and (_AVX512_CORE <= flags or "avx_ne_convert" in flags)
        return cls(level, flags, onednn, bf16, aten_capability)

    @property
    def avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        return _AVX512_CORE <= self.flags

    @property
    def int8_dot(self) -> bool:
        """int8 products summed exactly in int32 in hardware (VNNI or AMX-INT8)."""
        return any(f in self.flags for f in INT8_DOT_FLAGS)

    @property
    def bf16_dot(self) -> bool:
        """bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16): bf16 GEMMs beat float32's."""
        return any(f in self.flags for f in BF16_DOT_FLAGS)

    @property
    def amx_bf16(self) -> bool:
        return "amx_bf16" in self.flags

    def instruction_sets(self) -> str:
        """The vector features kernels choose by, as one line (e.g. `avx2 fma avx512f ... amx_bf16`)."""
        named = ("avx2", "fma", *sorted(_AVX512_CORE), *INT8_DOT_FLAGS, *BF16_DOT_FLAGS, "avx_ne_convert")
        return " ".join(f for f in named if f in self.flags) or "none"


def _detect(level: str) -> CpuCapabilities:
    import torch

    flags = lowered_flags(cpu_flags(), level)
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    caps = CpuCapabilities.from_flags(flags, onednn, level, torch.backends.cpu.get_cpu_capability())
    if caps.onednn_bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        caps = CpuCapabilities(level, flags, onednn, False, caps.aten_capability)
    return caps


@functools.lru_cache(maxsize=None)
def _capabilities(level: str, onednn_enabled: bool) -> CpuCapabilities:
    return _detect(level)


def capabilities() -> CpuCapabilities:
    """This process's capabilities at the level in force (`ECOSERVE_CPU_ISA`); cached per level."""
    import torch

    return _capabilities(target_isa(), torch.backends.mkldnn.enabled)


def apply_isa_limits() -> None:
    """Under ECOSERVE_CPU_ISA, lower oneDNN and ATen to the same level (unless set already): they read these
    variables at their first kernel, so this must run before a GEMM does."""
    level = target_isa()
    if level != "native":
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", LEVELS[level].onednn)
        os.environ.setdefault("ATEN_CPU_CAPABILITY", LEVELS[level].aten)
