"""Weight-only quantized layers: GGUF Q4_0 / Q4_1 / Q8_0 blocks against their dequantized reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as GGML
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ecoserve.model import quant
from ecoserve.model.quant import QuantLinear, dequantize_torch, quantize_q8_0

TYPES = [GGML.Q4_0, GGML.Q4_1, GGML.Q8_0]
K, N = 256, 96


def _blocks(qtype: GGML, seed: int = 0, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 blocks [N, row_bytes] as gguf-py quantizes, their float32 dequantization [N, k])."""
    w = torch.randn(N, k, generator=torch.Generator().manual_seed(seed)).numpy()
    blocks = gguf_quantize(w, qtype)
    return torch.from_numpy(blocks), torch.from_numpy(gguf_dequantize(blocks, qtype).astype(np.float32))


def _int8_activations(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel quantizes it: int8 per 32-block, scale max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def _q4_1_offsets(blocks: torch.Tensor, k: int = K) -> torch.Tensor:
    """Each weight's centred block offset m + 8 d (a Q4_1 block: fp16 d, fp16 m, nibbles) as [N, k]."""
    halves = blocks.reshape(N, k // 32, 20)[..., 0:4].contiguous().view(torch.float16).float()
    offset = halves[..., 1:2] + 8 * halves[..., 0:1]
    return offset.expand(N, k // 32, 32).reshape(N, k)


native = pytest.mark.skipif(quant._native() is None, reason="native quant_matmul kernel not built")


def _build(variant: str):
    """The kernel as the engine builds it here ("native"), or the same source built for plain AVX2
    (`ECOSERVE_CPU_ISA=avx2`: what a machine without AVX-512 or VNNI runs), or None where it cannot be built."""
    from ecoserve.kernels import quant_matmul

    return quant._native() if variant == "native" else quant_matmul(isa=variant)


# every integer dot path this machine can run: the native one (AVX512-VNNI on such a CPU) and AVX2
KERNEL_BUILDS = ["native", pytest.param("avx2", marks=pytest.mark.slow)]


def _kernel(variant: str):
    module = _build(variant)
    if module is None:
        pytest.skip(f"{variant} quant_matmul kernel not built")
    if variant == "avx2":
        assert module.isa() == "avx2"
    return module


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_torch_dequantization_equals_gguf_reference(qtype):
    blocks, ref = _blocks(qtype)
    assert torch.equal(dequantize_torch(blocks, int(qtype), K), ref)


@native
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_native_dequantization_equals_gguf_reference(qtype):
    blocks, ref = _blocks(qtype)
    assert torch.equal(quant._native().dequantize(blocks, int(qtype), K), ref)


def test_native_kernel_takes_the_widest_integer_dot_the_cpu_has():
    from ecoserve.kernels.cpu import capabilities

    module = _kernel("native")
    flags = capabilities().flags  # at the level in force (ECOSERVE_CPU_ISA builds for it)
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        assert module.isa() == "avx512-vnni"
    elif "avx2" in flags:
        assert module.isa() in ("avx2", "avx2-vnni")


@pytest.mark.parametrize("variant", KERNEL_BUILDS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,k", [(1, K), (3, K), (4, K), (7, K), (16, K), (1, K + 32), (5, K + 32)])
def test_native_matmul_matches_dequantized_reference(variant, qtype, rows, k):
    """K + 32 has an odd number of blocks: the 512-bit path's last block takes the 256-bit one."""
    module = _kernel(variant)
    blocks, ref = _blocks(qtype, seed=rows, k=k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + rows))
    out = module.quant_linear(x, blocks, int(qtype))
    # exact up to float summation order, given the kernel's int8 rounding of the activations (Q4_1's
    # offsets m + 8 d multiply the float activations) ...
    offsets = _q4_1_offsets(blocks, k) if qtype == GGML.Q4_1 else torch.zeros_like(ref)
    emulated = _int8_activations(x) @ (ref - offsets).T + x @ offsets.T
    assert (out - emulated).abs().max().item() <= 1e-4 * emulated.abs().max().item()
    # ... and that rounding costs at most 2% of the largest output against float activations
    exact = x @ ref.T
    assert (out - exact).abs().max().item() <= 2e-2 * exact.abs().max().item()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch-fallback"])
def test_quant_linear_module_small_and_large_batches(qtype, use_native, monkeypatch):
    if use_native and quant._native() is None:
        pytest.skip("native quant_matmul kernel not built")
    if not use_native:
        monkeypatch.setattr(quant, "_native", lambda: None)
    blocks, ref = _blocks(qtype)
    layer = QuantLinear(K, N, int(qtype), bias=True)
    layer.weight.data.copy_(blocks)
    layer.bias.data.copy_(torch.arange(N, dtype=torch.float32))
    for rows in (2, quant.MAX_KERNEL_ROWS + 1):  # decode: integer kernel; prefill: dequantize + float GEMM
        x = torch.randn(1, rows, K)
        expected = F.linear(x, ref, layer.bias)
        tol = 2e-2 if use_native and rows <= quant.MAX_KERNEL_ROWS else 1e-5
        assert layer(x).shape == (1, rows, N)
        assert (layer(x) - expected).abs().max().item() <= tol * expected.abs().max().item()


def test_q8_0_quantization_matches_gguf_and_round_trips():
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(3))
    blocks = quantize_q8_0(w)
    assert torch.equal(blocks, torch.from_numpy(gguf_quantize(w.numpy(), GGML.Q8_0)))
    step = w.reshape(N, -1, 32).abs().amax(-1, keepdim=True) / 127
    err = (dequantize_torch(blocks, 8, K) - w).reshape(N, -1, 32).abs()
    assert bool((err <= step * 0.57).all())  # half a step, plus up to 127 times the fp16 scale's rounding


def test_quantized_layers_reject_widths_not_made_of_blocks():
    from ecoserve.model.spec import ModelLoadError

    with pytest.raises(ModelLoadError, match="divisible by 32"):
        QuantLinear(100, 8, int(GGML.Q8_0))
