"""Paged KV storage for all layers of one model (the tensors; block accounting lives in ecoserve.kv)."""
from __future__ import annotations

import torch

_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype: 'auto' keeps K/V in the model's dtype; a named one stores them converted (a float32
    cache keeps a bfloat16 model's K/V exactly; a bfloat16 cache halves a float32 model's KV bytes)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    return _CACHE_DTYPES[kv_cache_dtype]


class PagedKVCache:
    """KV tensors for all layers: [num_layers, num_blocks, block_size, kv_heads, head_dim].

    Reads gather whole blocks (contiguous runs of block_size tokens), which moves memory several
    times faster on CPU than gathering token slots one by one.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded decode gathers read unwritten slots (masked out), and garbage that
        # happens to be NaN would poison the masked softmax (0 * NaN = NaN)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """K and V of one token in every layer, in the cache's element type `dtype`."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
