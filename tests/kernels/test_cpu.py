"""The capability probe and the kernel table: lowering the instruction set, each op's decision on described
CPUs, `ecoserve env`, and that nothing outside the probe reads the CPU itself."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ecoserve import kernels
from ecoserve.kernels import cpu, paths
from ecoserve.kernels.cpu import CpuCapabilities

AVX2 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
SKYLAKE = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
CASCADE_LAKE = SKYLAKE | {"avx512_vnni"}
ALDER_LAKE = AVX2 | {"avx_vnni"}
SAPPHIRE_RAPIDS = CASCADE_LAKE | {"avx512_bf16", "avx512_fp16", "avx512_vbmi2", "amx_tile", "amx_int8", "amx_bf16",
                                  "avx_vnni"}


def test_lowering_hides_every_flag_above_the_level():
    assert cpu.lowered_flags(frozenset(SAPPHIRE_RAPIDS), "native") == SAPPHIRE_RAPIDS
    assert cpu.lowered_flags(frozenset(SAPPHIRE_RAPIDS), "avx2") == AVX2
    assert cpu.lowered_flags(frozenset(SAPPHIRE_RAPIDS), "avx512") == SKYLAKE
    assert cpu.lowered_flags(frozenset(ALDER_LAKE), "avx2") == AVX2
    assert cpu.lowered_flags(frozenset(AVX2), "avx512") == AVX2  # nothing to lower


def test_level_comes_from_the_argument_or_the_environment(monkeypatch):
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    assert cpu.target_isa() == "native" and cpu.target_isa("AVX512") == "avx512"
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert cpu.target_isa() == "avx2" and cpu.target_isa("native") == "native"
    monkeypatch.setenv(cpu.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="ECOSERVE_CPU_ISA='sse2': expected native or one of"):
        cpu.capabilities()


@pytest.fixture
def fresh_probe():
    """The probe's cache cleared before and after: the test describes another CPU's flags."""
    cpu._capabilities.cache_clear()
    yield
    cpu._capabilities.cache_clear()


def test_capabilities_follow_the_level_in_force(monkeypatch, fresh_probe):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(SAPPHIRE_RAPIDS))
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    caps = cpu.capabilities()
    assert caps.level == "avx2" and caps.flags == AVX2
    assert not (caps.avx512 or caps.int8_dot or caps.bf16_dot or caps.amx_bf16 or caps.onednn_bf16) and caps.avx2
    monkeypatch.setenv(cpu.ISA_ENV, "avx512")
    caps = cpu.capabilities()
    assert caps.avx512 and not caps.int8_dot and not caps.bf16_dot
    assert caps.onednn_bf16 == torch.ops.mkldnn._is_mkldnn_bf16_supported()  # torch's own check has the last word


def test_isa_limits_reach_onednn_and_aten_unless_set(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    cpu.apply_isa_limits()
    import os

    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["ATEN_CPU_CAPABILITY"] == "default"


@pytest.mark.parametrize("flags,int8_onednn,bf16_packed,bf16_auto,lora_bf16,sdpa_prefill", [
    (AVX2, False, False, False, False, False),
    (ALDER_LAKE, True, False, False, False, False),  # AVX-VNNI: int8 dot products without AVX-512
    (SKYLAKE, False, True, False, False, False),  # oneDNN emulates bf16 on AVX-512 BW, but no bf16 dots
    (CASCADE_LAKE, True, True, False, False, False),
    (SAPPHIRE_RAPIDS, True, True, True, True, True),
])
def test_each_op_decides_from_the_capabilities(flags, int8_onednn, bf16_packed, bf16_auto, lora_bf16, sdpa_prefill):
    caps = CpuCapabilities.from_flags(flags)
    assert paths.w8a8_onednn(caps) == int8_onednn
    assert paths.packable_dtypes(caps) == ({torch.float32, torch.bfloat16} if bf16_packed else {torch.float32})
    assert paths.bf16_is_fast(caps) == bf16_auto
    assert paths.native_lora(torch.bfloat16, caps) == lora_bf16 and paths.native_lora(torch.float32, caps)
    assert paths.sdpa_prefill_is_faster(torch.bfloat16, caps) == sdpa_prefill
    assert not paths.sdpa_prefill_is_faster(torch.float32, caps)


def test_without_onednn_nothing_is_packed_and_w8a8_takes_int_mm():
    caps = CpuCapabilities.from_flags(SAPPHIRE_RAPIDS, onednn=False)
    assert paths.packable_dtypes(caps) == frozenset() and not paths.w8a8_onednn(caps)
    assert not paths.native_lora(torch.float32, caps) and not paths.onednn_available(caps)


def test_kernel_table_states_the_decisions_it_is_made_of():
    table = {(row.op, row.dtype): row for row in paths.kernel_table()}
    exact = "native int8_gemm (sign trick)" if kernels.quant_matmul() is not None else "torch._int_mm"
    assert table[("w8a8 GEMM", "int8")].path == ("oneDNN int8 prepacked" if paths.w8a8_onednn() else exact)
    assert table[("linear", "bfloat16")].path == ("oneDNN prepacked" if paths.onednn_linear(torch.bfloat16)
                                                  else "oneDNN float32, widened")
    assert table[("--dtype auto, half checkpoint", "")].path == ("bfloat16" if paths.bf16_is_fast() else "float32")
    assert all(row.path and row.why for row in table.values())
    described = {(row.op, row.dtype): row for row in paths.kernel_table(CpuCapabilities.from_flags(AVX2))}
    assert described[("w8a8 GEMM", "int8")].path == exact
    assert described[("linear", "bfloat16")].path == "oneDNN float32, widened"
    no_onednn = {(row.op, row.dtype): row for row in paths.kernel_table(CpuCapabilities.from_flags(AVX2, onednn=False))}
    assert no_onednn[("linear", "bfloat16")].path == "torch F.linear"
    assert "saturate" in described[("w8a8 GEMM", "int8")].why


def test_ecoserve_env_prints_the_machine_and_the_table(capsys):
    from ecoserve.cli import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "instruction level" in out and "ATen CPU capability" in out and "oneDNN" in out
    for op in ("linear", "w8a8 GEMM", "GGUF / Q8_0 matmul", "attention, decode", "MoE experts", "LoRA SGMV"):
        assert re.search(rf"^{re.escape(op)}\s", out, re.M), op


def test_a_level_with_nothing_to_lower_reuses_the_native_build(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(AVX2))
    assert kernels._build_isa("avx2") == "native"
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset(ALDER_LAKE))
    assert kernels._build_isa("avx2") == "avx2"


# what reads the CPU or asks torch about it: only the probe may
_PROBES = re.compile(r"/proc/cpuinfo|\bcpu_flags\(|_is_mkldnn_bf16_supported|mkldnn\.is_available|"
                     r"get_cpu_capability|\"(amx|avx)[a-z0-9_]*\" (not )?in ")


def test_nothing_outside_the_probe_reads_the_cpu():
    root = Path(kernels.__file__).parents[1]
    allowed = {root / "kernels" / "cpu.py", root / "kernels" / "__init__.py", root / "kernels" / "paths.py"}
    offenders = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py")) if path not in allowed
                 for n, line in enumerate(path.read_text().splitlines(), 1) if _PROBES.search(line)]
    assert not offenders, offenders


def test_every_isa_sensitive_module_exists():
    """A renamed module must not drop out of the lowered pass (conftest's `isa` mark) unnoticed."""
    from tests.conftest import ISA_SENSITIVE

    tests = Path(__file__).parents[1]
    assert all((tests / name).is_file() for name in ISA_SENSITIVE)
