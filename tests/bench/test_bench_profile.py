"""The per-precision profile: op categories, the breakdown's arithmetic, the work a workload asks for,
and one profiled run of a small model whose GEMM and Python time are known to be there."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from ecoserve.bench import roofline
from ecoserve.bench.profile import (ATTENTION, CATEGORIES, ELEMENTWISE, GEMM, REST, SAMPLING, Breakdown, op_category,
                                    profile_run, side_by_side)
from ecoserve.bench.roofline import Roofline, Work
from ecoserve.kernels import fused_ops
from ecoserve.kernels.paths import bf16_is_fast, onednn_linear
from ecoserve.model.packed import PackedLinear, onednn_available

CONFIG = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=16, vocab_size=100)


@pytest.mark.parametrize("op,category", [
    ("mkldnn::_linear_pointwise", GEMM), ("onednn::qlinear_pointwise", GEMM), ("aten::addmm", GEMM),
    ("aten::index_copy_", ATTENTION), ("aten::_scaled_dot_product_flash_attention_for_cpu", ATTENTION),
    ("aten::silu", ELEMENTWISE), ("aten::copy_", ELEMENTWISE), ("aten::argmax", SAMPLING),
    ("aten::empty", REST), ("aten::as_strided", REST), ("ecoserve::paged_decode", ATTENTION),
    ("ecoserve::rms_norm", ELEMENTWISE), ("ecoserve::something_new", REST),
])
def test_op_categories(op, category):
    assert op_category(op) == category


def test_linear_flops_count_every_projection():
    # q 8x8, k and v 8x4 each, o 8x8, gate and up 8x16 each, down 16x8: 576 multiply-adds per layer
    assert roofline.linear_flops_per_token(CONFIG) == 2 * 2 * 576
    assert roofline.attention_flops_per_token(CONFIG, 10) == 2 * 4 * 2 * 4 * 10


def test_work_counts_decode_contexts_and_the_lm_head():
    work = Work.of(CONFIG, prompt_lens=[3, 5], output_lens=[4, 1], kv_bytes_per_token=64)
    # request 1: decode steps over 4, 5 and 6 tokens of context; request 2 has no decode step
    assert work.decode_kv_bytes == (4 + 5 + 6) * 64
    assert work.gemm_flops == (3 + 5 + 4 + 1) * roofline.linear_flops_per_token(CONFIG) + 5 * 2 * 8 * 100


def _breakdown(seconds: dict[str, float], elapsed: float = 10.0) -> Breakdown:
    work = Work(gemm_flops=60e9, decode_kv_bytes=2e9)
    return Breakdown("ecoserve bfloat16", elapsed, seconds, steps=100, work=work, weight_bytes_per_step=int(0.25e9),
                     roofline=Roofline("bfloat16", 2, gemm_peak_gflops=500.0, memory_gbps=10.0))


def test_breakdown_shares_and_roofline_fractions():
    b = _breakdown({GEMM: 4.0, ATTENTION: 2.0, ELEMENTWISE: 1.0, SAMPLING: 0.5, REST: 2.5})
    assert sum(b.shares.values()) == pytest.approx(1.0)
    assert b.shares[GEMM] == pytest.approx(0.4)
    assert b.gemm_gflops == pytest.approx(15.0)  # 60 GFLOP in 4 s of GEMM
    assert b.gemm_peak_fraction == pytest.approx(0.03)
    assert b.streamed_bytes == pytest.approx(100 * 0.25e9 + 2e9)
    assert b.memory_gbps == pytest.approx(2.7)  # 27 GB over the 10 s run
    assert b.memory_fraction == pytest.approx(0.27)
    d = b.to_dict()
    assert d["roofline"]["gemm_peak_gflops"] == 500.0 and d["gemm_peak_fraction"] == pytest.approx(0.03)
    table = side_by_side([b, _breakdown({**b.seconds, GEMM: 1.0}, 7.0)])
    assert "4.00 s 40%" in table and "1.00 s 14%" in table and "3% of the bfloat16 packed-GEMM peak" in table


def test_shares_still_sum_to_one_when_ops_overrun_the_run():
    b = _breakdown({GEMM: 8.0, ATTENTION: 4.0, ELEMENTWISE: 0.0, SAMPLING: 0.0, REST: 0.0}, elapsed=10.0)
    assert sum(b.shares.values()) == pytest.approx(1.0) and b.shares[GEMM] == pytest.approx(2 / 3)


class _Toy(nn.Module):
    """A forward with a prepacked linear, a native RMSNorm (when built) and Python time outside every op."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = PackedLinear(torch.randn(256, 256), None)
        self.norm = nn.Parameter(torch.ones(256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            x = self.proj(x)
        native = fused_ops()
        if native is not None:
            x = native.rms_norm(x, self.norm, 1e-6)
        sum(i * i for i in range(20_000))
        return x


@pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")
def test_profile_run_finds_the_gemm_the_native_kernel_and_python():
    model, x = _Toy(), torch.randn(64, 256)

    def run():
        with torch.inference_mode():
            for _ in range(5):
                model(x)

    run()
    t0 = time.perf_counter()
    run()
    elapsed = time.perf_counter() - t0
    ceiling = roofline.measure("float32", torch.get_num_threads())
    work = Work(gemm_flops=5 * 8 * 2 * 64 * 256 * 256, decode_kv_bytes=0.0)
    b, top = profile_run(run, label="toy", elapsed_s=elapsed, model=model, work=work,
                         weight_bytes_per_step=roofline.weight_bytes_per_step(model), roofline=ceiling)
    assert b.steps == 5  # forwards of one pass: the same work as the timed run
    assert set(b.seconds) == set(CATEGORIES)
    assert b.seconds[GEMM] > 0 and b.seconds[REST] > 0
    if fused_ops() is not None:
        assert b.seconds[ELEMENTWISE] > 0  # rms_norm is a pybind call that only cProfile sees
    assert sum(b.shares.values()) == pytest.approx(1.0)
    # wide: the peak and the toy's GEMMs run at different moments of a shared machine; a FLOP count off by a
    # layer count or a unit (1e6 for 1e9) lands far outside
    assert 0 < b.gemm_peak_fraction < 10
    assert "forward" in top


def test_weight_bytes_per_step_leave_out_an_untied_embedding():
    class Model(nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(100, 8)
            self.layer = nn.Linear(8, 8, bias=False)
            self.lm_head = nn.Linear(8, 100, bias=False)
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    assert roofline.weight_bytes_per_step(Model(tied=False)) == (8 * 8 + 100 * 8) * 4
    assert roofline.weight_bytes_per_step(Model(tied=True)) == (8 * 8 + 100 * 8) * 4  # the table is the LM head


@pytest.mark.skipif(not (bf16_is_fast() and onednn_linear(torch.bfloat16)), reason="no bfloat16 instructions")
def test_bfloat16_gemm_peak_beats_float32_where_the_cpu_has_bf16():
    """The peak goes through the packed bfloat16 path (AMX / AVX512-BF16), not a float32 fallback."""
    bf16, f32 = (roofline.measure("bfloat16", 1), roofline.measure("float32", 1))
    assert bf16.gemm_peak_gflops > 1.5 * f32.gemm_peak_gflops
    assert bf16.num_threads == 1 and bf16.memory_gbps == f32.memory_gbps  # one bandwidth per thread count


def test_memory_bandwidth_is_plausible():
    assert 0.1 < roofline.measure_memory_bandwidth(nbytes=64 * 2**20, min_s=0.1) < 2000
