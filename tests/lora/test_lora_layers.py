"""`LoRALinear` on a bfloat16 model: small steps take the float32 copies, large ones the bf16 slots; both add
each row's own adapter (contiguous and gathered rows, several slots, base rows untouched)."""

import pytest
import torch
from torch import nn

from ecoserve.lora.checkpoint import ModuleShape
from ecoserve.lora.layers import FLOAT32_LIMIT, LoRALinear, LoRAStep, Segment

IN, SLICES, RANK, SLOTS = 64, (48, 16, 16), 4, 3


def make_module(gen):
    base = nn.Linear(IN, sum(SLICES), bias=False).to(torch.bfloat16)
    step = LoRAStep(SLOTS)
    step.ready = [1] * SLOTS
    module = LoRALinear(base, 0, ModuleShape(IN, SLICES), SLOTS, max_rank=8, dtype=torch.bfloat16,
                        device=torch.device("cpu"), step=step)
    adapters = {}
    for slot in range(SLOTS):
        a = torch.randn(len(SLICES) * RANK, IN, generator=gen).to(torch.bfloat16)
        bts = [torch.randn(RANK, size, generator=gen).to(torch.bfloat16) for size in SLICES]
        module.load_slot(slot, (a, bts), RANK)
        adapters[slot] = (a, bts)
    return module, step, adapters


def reference(x, base, a, bts):
    """x W^T + per slice i: x A_i^T B_i^T, in float64."""
    h = x.double() @ a.double().t()
    delta = torch.cat([h[:, i * RANK:(i + 1) * RANK] @ bt.double() for i, bt in enumerate(bts)], dim=1)
    return base(x).double() + delta


@pytest.mark.parametrize("rows", [6, 600])
@pytest.mark.parametrize("gathered", [False, True])
def test_rows_get_their_own_adapter(rows, gathered):
    gen = torch.Generator().manual_seed(rows)
    module, step, adapters = make_module(gen)
    assert module.lora_a32 is not None and module.lora_a32.dtype == torch.float32
    small = rows * len(SLICES) * RANK <= FLOAT32_LIMIT
    assert small == (rows == 6)
    x = torch.randn(rows, IN, generator=gen).to(torch.bfloat16)
    third = rows // 3
    if gathered:  # slot 0 takes every third row, slot 2 the rows after it; the rest are base rows
        seg_rows = {0: torch.arange(0, rows, 3), 2: torch.arange(1, rows, 3)}
    else:
        seg_rows = {0: slice(0, third), 2: slice(third, 2 * third)}
    step.set_segments([Segment(slot, RANK, r) for slot, r in seg_rows.items()], rows)
    with torch.no_grad():
        y = module(x).double()
        base_y = module.base(x).double()
        for slot, r in seg_rows.items():
            want = reference(x[r], module.base, *adapters[slot])
            # bf16 output: one rounding of a value of this size (float32 path) or a few (bf16 GEMMs)
            torch.testing.assert_close(y[r], want, rtol=0.02, atol=0.05 * want.abs().max().item() / 8)
        covered = torch.zeros(rows, dtype=torch.bool)
        for r in seg_rows.values():
            covered[r] = True
        assert torch.equal(y[~covered], base_y[~covered])  # base rows pay nothing and get nothing


def test_float32_copies_follow_the_slot():
    gen = torch.Generator().manual_seed(0)
    module, _, adapters = make_module(gen)
    module.load_slot(1, None, RANK)
    assert not module.adapted[1]
    assert module.lora_a32[1].abs().sum() == 0 and module.lora_bt32[1].abs().sum() == 0
    a, _ = adapters[2]
    assert torch.equal(module.lora_a32[2, :len(SLICES) * RANK], a.float())


def test_float32_model_keeps_no_copies():
    step = LoRAStep(1)
    module = LoRALinear(nn.Linear(IN, IN), 0, ModuleShape(IN, (IN,)), 1, 8, torch.float32, torch.device("cpu"), step)
    assert module.lora_a32 is None and module.lora_bt32 is None
