"""--dtype auto on CPU: bfloat16 for half-precision checkpoints where the CPU has bf16 instructions, float32
elsewhere, float32 activations under quantization; the one log line for bf16 without bf16 instructions."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from ecoserve.kernels import cpu
from ecoserve.kernels.cpu import CpuCapabilities
from ecoserve.kernels.paths import bf16_is_fast
from ecoserve.model.loader import load_model, load_model_info, resolve_dtype, warn_if_slow_bf16
from tests.utils import make_tiny_checkpoint, make_tiny_gguf

AMX = CpuCapabilities.from_flags({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
AVX512_BF16 = CpuCapabilities.from_flags({"avx512f", "avx512_bf16"})
# an AVX-512 CPU without bf16 (e.g. Skylake/Cascade Lake)
NO_BF16 = CpuCapabilities.from_flags({"avx2", "avx512f", "avx512_vnni"})


@pytest.mark.parametrize("checkpoint,quantization,caps,expected", [
    ("bfloat16", None, AMX, torch.bfloat16),
    ("bfloat16", None, AVX512_BF16, torch.bfloat16),
    ("float16", None, AMX, torch.bfloat16),  # as vLLM's CPU backend: a float16 checkpoint runs in bf16 on CPU
    ("float32", None, AMX, torch.float32),
    (None, None, AMX, torch.float32),  # a config without a dtype: the exact choice
    ("bfloat16", None, NO_BF16, torch.float32),
    ("bfloat16", None, CpuCapabilities.from_flags(set()), torch.float32),  # no /proc/cpuinfo
    ("bfloat16", "int8", AMX, torch.float32),  # quantized weights take float32 activations
    ("bfloat16", "gguf", AMX, torch.float32),
    ("bfloat16", "w8a8", AMX, torch.bfloat16),  # int8 GEMMs between bfloat16 activations, as vLLM's CPU W8A8
    ("float32", "w8a8", AMX, torch.float32),
    ("bfloat16", "w8a8", NO_BF16, torch.float32),
    ("bfloat16", "none", AMX, torch.bfloat16),
])
def test_auto_on_cpu(checkpoint, quantization, caps, expected):
    assert resolve_dtype("auto", "cpu", checkpoint, quantization, caps) == expected


def test_explicit_dtypes_and_accelerators_ignore_the_cpu_rule():
    assert resolve_dtype("bfloat16", "cpu", "float32", caps=NO_BF16) == torch.bfloat16
    assert resolve_dtype("float32", "cpu", "bfloat16", caps=AMX) == torch.float32
    assert resolve_dtype("auto", "cuda", "float16", caps=NO_BF16) == torch.float16
    assert resolve_dtype("auto", "cuda", "float32", caps=NO_BF16) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int3")


def test_bf16_is_fast_with_either_flag():
    assert bf16_is_fast(AMX) and bf16_is_fast(AVX512_BF16) and bf16_is_fast(CpuCapabilities.from_flags({"amx_bf16"}))
    assert not bf16_is_fast(NO_BF16) and not bf16_is_fast(CpuCapabilities.from_flags(set()))


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny llama whose config.json records bfloat16, as most hub checkpoints do."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "m", "llama")
    config = json.loads((path / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_load_model_auto_follows_the_cpu(bf16_checkpoint, monkeypatch):
    monkeypatch.setattr(cpu, "capabilities", lambda: AMX)
    assert load_model(str(bf16_checkpoint)).model.dtype == torch.bfloat16
    assert load_model(str(bf16_checkpoint), quantization="int8").model.dtype == torch.float32
    monkeypatch.setattr(cpu, "capabilities", lambda: NO_BF16)
    assert load_model(str(bf16_checkpoint)).model.dtype == torch.float32


def test_bf16_without_bf16_instructions_logs_one_line_and_runs(bf16_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(cpu, "capabilities", lambda: NO_BF16)
    with caplog.at_level(logging.WARNING, logger="ecoserve.model.loader"):
        model = load_model(str(bf16_checkpoint), dtype="bfloat16").model
    lines = [r.getMessage() for r in caplog.records if "bf16 instructions" in r.getMessage()]
    assert model.dtype == torch.bfloat16 and len(lines) == 1
    assert "widened to float32" in lines[0] and "--dtype float32" in lines[0]
    caplog.clear()
    monkeypatch.setattr(cpu, "capabilities", lambda: AMX)
    with caplog.at_level(logging.WARNING, logger="ecoserve.model.loader"):
        load_model(str(bf16_checkpoint), dtype="bfloat16")
    assert not [r for r in caplog.records if "bf16 instructions" in r.getMessage()]


def test_the_warning_is_for_bf16_on_cpu_only():
    assert warn_if_slow_bf16(torch.bfloat16, "cpu", NO_BF16)
    assert not warn_if_slow_bf16(torch.bfloat16, "cpu", AVX512_BF16)
    assert not warn_if_slow_bf16(torch.float32, "cpu", NO_BF16)
    assert not warn_if_slow_bf16(torch.bfloat16, "cuda", NO_BF16)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_converted_gguf_records_float32_so_auto_keeps_it(tmp_path, quantized):
    """The embedded default is a GGUF: its conversion holds float32 weights (exact for every GGUF type) and says so,
    so auto runs it in float32 on any CPU."""
    from gguf import GGMLQuantizationType

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", "llama")
    gguf = make_tiny_gguf(ckpt, tmp_path / "tiny.gguf", GGMLQuantizationType.Q8_0 if quantized else None)
    recorded = load_model_info(str(gguf), skip_tokenizer_init=True).spec.torch_dtype
    assert recorded == "float32"
    assert resolve_dtype("auto", "cpu", recorded, caps=AMX) == torch.float32
