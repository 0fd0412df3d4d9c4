"""The decoder layer's elementwise chains through native kernels on CPU, float32 or bfloat16 (ecoserve.kernels).

Each replaces 4-9 torch ops, with their Python calls and temporaries, by one pass over the rows:
RMSNorm, the rotation of q and k (in place, inside the fused qkv output) and SiLU-and-mul. Their
float operations are torch's in the same order, so rotary and SiLU-mul's products round alike
(rotary bit-equal); RMSNorm sums its squares in another order (within 2e-6). In bfloat16 they round
to bf16 after each op as torch's bf16 ops do (rotary bit-equal; RMSNorm and SiLU-mul within one bf16
step, where the float32 value sits on a rounding boundary). Anything else (another device or dtype,
non-contiguous rows, no compiler) runs the torch ops.
"""
from __future__ import annotations

import torch

from ecoserve.kernels import fused_ops


def native_for(x: torch.Tensor):
    """The fused-ops module when x can use it (built once, then cached), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return fused_ops()
