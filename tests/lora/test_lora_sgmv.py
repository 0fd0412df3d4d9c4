"""The native all-segments LoRA kernel against the per-slot torch computation it replaces."""
import pytest
import torch

from ecoserve.lora.checkpoint import ModuleShape
from ecoserve.lora.layers import LoRALinear, LoRAStep, Segment, native_sgmv

pytestmark = pytest.mark.skipif(native_sgmv(torch.float32, torch.device("cpu")) is None,
                                reason="no native LoRA kernel on this machine")


def make(dtype, shape, slots, max_rank):
    step = LoRAStep(slots)
    step.ready = [10**6] * slots  # every layer resident
    base = torch.nn.Linear(shape.in_features, sum(shape.slice_sizes), bias=False).to(dtype)
    return LoRALinear(base, 0, shape, slots, max_rank, dtype, torch.device("cpu"), step), step


def reference(x, y, adapters, segments, n):
    out = y.clone().float()
    for seg in segments:
        a, bts, rank = adapters[seg.slot]
        rows = torch.arange(seg.rows.start, seg.rows.stop) if isinstance(seg.rows, slice) else seg.rows
        h = (x[rows].float() @ a.float().t()).to(x.dtype).float()  # torch rounds the shrink to the dtype
        b = torch.zeros(n * rank, out.shape[1])
        o = 0
        for i, bt in enumerate(bts):
            b[i * rank:(i + 1) * rank, o:o + bt.shape[1]] = bt.float()
            o += bt.shape[1]
        out[rows] += h @ b
    return out.to(y.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("slices,in_features,ranks", [((40, 24, 24), 64, (8, 3, 16)), ((96,), 130, (1, 5, 7)),
                                                      ((300, 300), 66, (2, 16, 4))])
def test_native_kernel_matches_per_slot_reference(dtype, threads, slices, in_features, ranks):
    if native_sgmv(dtype, torch.device("cpu")) is None:
        pytest.skip(f"no native LoRA kernel for {dtype} here")
    torch.manual_seed(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        shape = ModuleShape(in_features, slices)
        n = len(slices)
        module, step = make(dtype, shape, 4, 16)
        assert module.sgmv is not None
        adapters = {}
        for slot, rank in zip((0, 2, 3), ranks):
            a = (torch.randn(n * rank, in_features) / in_features ** 0.5).to(dtype)
            bts = [(torch.randn(rank, size) * 0.1).to(dtype) for size in slices]
            module.load_slot(slot, (a, bts), rank)
            adapters[slot] = (a, bts, rank)
        tokens = 77
        x = torch.randn(tokens, in_features).to(dtype)
        # a contiguous run of 40 rows (two row blocks), gathered rows, one single row; rows 71-76 are base rows
        segments = [Segment(0, ranks[0], slice(0, 40)),
                    Segment(2, ranks[1], torch.tensor([41, 45, 50, 52, 60, 61, 62, 63, 70])),
                    Segment(3, ranks[2], torch.tensor([40]))]
        step.set_segments(segments, tokens)
        got = module(x)
        want = reference(x, module.base(x), adapters, segments, n)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(got[71:], module.base(x)[71:], atol=0, rtol=0)  # base rows untouched
    finally:
        torch.set_num_threads(previous)


def test_reloading_a_slot_with_a_smaller_rank_leaves_nothing_of_the_old_adapter():
    shape = ModuleShape(32, (48,))
    module, step = make(torch.float32, shape, 2, 16)
    module.load_slot(1, (torch.randn(16, 32), [torch.randn(16, 48)]), 16)
    a, bt = torch.randn(4, 32), torch.randn(4, 48)
    module.load_slot(1, (a, [bt]), 4)
    x = torch.randn(5, 32)
    step.set_segments([Segment(1, 4, slice(0, 5))], 5)
    torch.testing.assert_close(module(x), module.base(x) + (x @ a.t()) @ bt)


def test_bad_indices_are_errors_not_reads_out_of_bounds():
    shape = ModuleShape(32, (48,))
    module, step = make(torch.float32, shape, 2, 8)
    x, y = torch.randn(3, 32), torch.zeros(3, 48)
    rows, bounds, slots, widths = torch.tensor([0, 5]), torch.tensor([0, 2]), torch.tensor([1]), torch.tensor([8])
    with pytest.raises(RuntimeError, match="row index 5 out of range"):
        module.sgmv(y, x, module.lora_a, module.lora_bt, rows, bounds, slots, widths)
    with pytest.raises(RuntimeError, match="slot 7 out of range"):
        module.sgmv(y, x, module.lora_a, module.lora_bt, rows[:1], torch.tensor([0, 1]), torch.tensor([7]), widths)
