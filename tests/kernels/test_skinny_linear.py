"""The native decode-rows linear (kernels/skinny_linear.cpp) on oneDNN's packed weights: the layout it
recognises, its output against a float64 reference, on this CPU's build and the AVX2-only one, and the
PackedLinear that chooses between it and oneDNN by the number of rows.

Tolerances: float32 within reassociation of the K-term sums (1e-5 of the output's scale); bfloat16 within
one rounding of the float32 result to bf16 (2^-8 of the value) plus that float32 error."""
import pytest
import torch
import torch.nn.functional as F

from ecoserve import kernels
from ecoserve.model import packed as packed_module
from ecoserve.model.packed import PackedLinear, onednn_available, pack_weight, packable_dtypes

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")

ISAS = kernels.distinct_builds()  # avx2 too where that build differs from this CPU's
DTYPES = [torch.float32, torch.bfloat16]
# (out, in): whole blocks, a partial last block, K off the padding unit, a tiny layer, more than one block
SHAPES = [(256, 128), (100, 36), (3, 5), (130, 64), (1280, 768)]


def kernel(isa: str, dtype: torch.dtype):
    module = kernels.skinny_linear(isa)
    if module is None:
        pytest.skip(f"no native skinny_linear kernel for {isa} on this machine (compiler or CPU)")
    if dtype not in packable_dtypes():
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    return module


def layer(out: int, inp: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=g).to(dtype), torch.randn(out, generator=g).to(dtype)


def assert_close(got: torch.Tensor, x, w, b):
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    scale = float(want.abs().max()) or 1.0
    err = (got.double() - want).abs()
    if got.dtype == torch.float32:
        assert float(err.max()) <= 1e-5 * scale
    else:
        assert bool((err <= 2.0 ** -8 * want.abs() + 1e-5 * scale).all()), float((err / scale).max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_the_reference_with_and_without_bias(isa, dtype, shape):
    module = kernel(isa, dtype)
    w, b = layer(*shape, dtype)
    packed = pack_weight(w)
    nb, v, kp = module.fit(packed, w)
    assert nb > 0 and kp >= shape[1] and kp % v == 0, "oneDNN's layout for this weight was not recognised"
    g = torch.Generator().manual_seed(1)
    for rows in (1, 3, 4, 5, 16):
        x = torch.randn(rows, shape[1], generator=g).to(dtype)
        for bias in (None, b):
            y = module.skinny_linear(x, packed, bias, shape[0], nb, v, kp)
            assert y.dtype == dtype and y.shape == (rows, shape[0])
            assert_close(y, x, w, bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_output_is_summed_alike_on_one_and_two_threads(dtype):
    module = kernel("native", dtype)
    w, b = layer(4096, 256, dtype)  # large enough to be split between threads
    packed = pack_weight(w)
    fit = module.fit(packed, w)
    x = torch.randn(4, 256).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = module.skinny_linear(x, packed, b, 4096, *fit)
        torch.set_num_threads(2)
        two = module.skinny_linear(x, packed, b, 4096, *fit)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_fit_rejects_a_weight_the_packed_one_was_not_made_from():
    module = kernel("native", torch.float32)
    w, _ = layer(128, 64, torch.float32)
    other = w.clone()
    other[77, 13] += 1.0  # one element off: no layout reproduces it
    assert module.fit(pack_weight(w), other) == (0, 0, 0)


def test_bad_layouts_and_inputs_are_errors():
    module = kernel("native", torch.float32)
    w, _ = layer(128, 64, torch.float32)
    packed = pack_weight(w)
    nb, v, kp = module.fit(packed, w)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="size does not match"):
        module.skinny_linear(x, packed, None, 128, nb, v, kp + 16)
    with pytest.raises(RuntimeError, match="layout"):
        module.skinny_linear(x, packed, None, 128, 48, v, kp)
    with pytest.raises(RuntimeError, match="bias"):
        module.skinny_linear(x, packed, torch.randn(7), 128, nb, v, kp)
    with pytest.raises(RuntimeError, match="dtype"):
        module.skinny_linear(x.double(), packed, None, 128, nb, v, kp)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_takes_decode_rows_through_the_loop_and_more_through_onednn(dtype, monkeypatch):
    most = kernel("native", dtype).max_rows(dtype)
    assert most == {torch.float32: 8, torch.bfloat16: 4}[dtype]
    w, b = layer(200, 96, dtype)
    lin = PackedLinear(w, b)
    assert lin.skinny_layout is not None and lin.skinny_rows == most
    onednn = []
    real = packed_module.packed_linear
    monkeypatch.setattr(packed_module, "packed_linear", lambda *a: onednn.append(a[0].shape[0]) or real(*a))
    for rows in (1, most, most + 1, 64):
        x = torch.randn(rows, 96).to(dtype)
        assert_close(lin(x), x, w, b)
    assert onednn == [most + 1, 64]


def test_a_layout_not_recognised_keeps_onednn_at_every_size(monkeypatch):
    module = kernel("native", torch.float32)

    class Unfit:
        fit = staticmethod(lambda packed, weight: (0, 0, 0))
        skinny_linear, max_rows = module.skinny_linear, module.max_rows

    monkeypatch.setattr(packed_module, "skinny_linear", lambda: Unfit)
    w, b = layer(64, 32, torch.float32)
    lin = PackedLinear(w, b)
    assert lin.skinny_rows == 0 and lin.skinny_layout is None
    x = torch.randn(1, 32)
    assert_close(lin(x), x, w, b)
