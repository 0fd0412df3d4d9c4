"""The native paged kernels refuse a block table, length or shape that would read outside the KV cache, with an
error that names the problem, instead of reading (or crashing on) memory they do not own."""
import pytest
import torch

from ecoserve import kernels
from ecoserve.engine.attention import PagedAttention
from ecoserve.engine.kv_cache import PagedKVCache

NUM_BLOCKS, BS, HKV, HQ, D = 6, 4, 2, 4, 16


@pytest.fixture(scope="module")
def cache():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)
    return k, torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen)


@pytest.fixture(scope="module")
def decode():
    fn = kernels.paged_decode()
    if fn is None:
        pytest.skip("the native paged decode kernel is unavailable here")
    return fn


@pytest.fixture(scope="module")
def prefill():
    fn = kernels.paged_prefill()
    if fn is None:
        pytest.skip("the native paged prefill kernel is unavailable here")
    return fn


def _decode_args(tables, lens, batch=2):
    return torch.randn(batch, HQ, D), torch.tensor(tables, dtype=torch.long), torch.tensor(lens, dtype=torch.long)


def test_decode_accepts_a_valid_table_and_ignores_its_padding(decode, cache):
    k, v = cache
    q, tables, lens = _decode_args([[3, 1, 5], [2, 10**9, -7]], [9, 2])  # row 1 reads one block: the rest is padding
    out = decode(q, k, v, tables, lens, 0.25)
    assert out.shape == q.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("tables, lens, match", [
    ([[3, 1, 6], [2, 0, 0]], [9, 2], r"block id 6 in row 0, column 2 is outside the cache's \[0, 6\)"),
    ([[3, 1, 5], [-1, 0, 0]], [9, 2], r"block id -1 in row 1, column 0"),
    ([[3, 1, 5], [2, 0, 0]], [13, 2], r"context length 13 of row 0 is outside \[1, 12\]"),
    ([[3, 1, 5], [2, 0, 0]], [9, 0], r"context length 0 of row 1"),
])
def test_decode_refuses_out_of_range_tables_and_lengths(decode, cache, tables, lens, match):
    k, v = cache
    q, tables, lens = _decode_args(tables, lens)
    with pytest.raises(RuntimeError, match=match):
        decode(q, k, v, tables, lens, 0.25)


def test_decode_refuses_inconsistent_shapes(decode, cache):
    k, v = cache
    q, tables, lens = _decode_args([[0, 1], [2, 3]], [5, 5])
    with pytest.raises(RuntimeError, match="tables must be"):
        decode(q, k, v, tables[:1], lens, 0.25)
    with pytest.raises(RuntimeError, match="lens"):
        decode(q, k, v, tables, lens[:1], 0.25)
    with pytest.raises(RuntimeError, match="k_cache and v_cache"):
        decode(q, k, v[:3].contiguous(), tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="head dim"):
        decode(torch.randn(2, HQ, D // 2), k, v, tables, lens, 0.25)


def _prefill_call(prefill, cache, spans, tables, tokens=6, out=None):
    k, v = cache
    q = torch.randn(tokens, HQ, D)
    out = torch.empty_like(q) if out is None else out
    prefill(q, k, v, out, torch.tensor(tables, dtype=torch.long), torch.tensor(spans, dtype=torch.long), 0.25)
    return out


def test_prefill_accepts_a_valid_batch(prefill, cache):
    out = _prefill_call(prefill, cache, [[0, 4, 7], [4, 2, 2]], [[4, 0], [1, 99]])  # span 1 reads block 1 only
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("spans, tables, match", [
    ([[0, 4, 7], [4, 2, 2]], [[4, 6], [1, 0]], r"block id 6 in row 0, column 1"),
    ([[0, 4, 7], [4, 2, 2]], [[4, 0], [-3, 0]], r"block id -3 in row 1, column 0"),
    ([[0, 4, 9], [4, 2, 2]], [[4, 0], [1, 0]], r"context length 9 of row 0 is outside \[1, 8\]"),
    ([[-1, 4, 7], [4, 2, 2]], [[4, 0], [1, 0]], r"span 0 .*outside the 6 query rows"),
    ([[0, 4, 7], [4, 3, 3]], [[4, 0], [1, 0]], r"span 1 .*outside the 6 query rows"),
    ([[0, 4, 3], [4, 2, 2]], [[4, 0], [1, 0]], r"span 0 .*attends fewer tokens than it computes"),
])
def test_prefill_refuses_out_of_range_spans_and_tables(prefill, cache, spans, tables, match):
    with pytest.raises(RuntimeError, match=match):
        _prefill_call(prefill, cache, spans, tables)


def test_prefill_refuses_inconsistent_shapes(prefill, cache):
    with pytest.raises(RuntimeError, match="spans \\[P, 3\\] and tables"):
        _prefill_call(prefill, cache, [[0, 4, 7], [4, 2, 2]], [[4, 0]])
    with pytest.raises(RuntimeError, match="out must have q's shape"):
        _prefill_call(prefill, cache, [[0, 4, 7]], [[4, 0]], out=torch.empty(5, HQ, D))


def test_a_slot_outside_the_cache_raises_before_any_write():
    """The slot mapping (where new K/V go) is written with torch's index_copy_, which checks every index."""
    cache = PagedKVCache(1, NUM_BLOCKS, BS, HKV, D, torch.float32, "cpu")
    attn = PagedAttention(cache, use_native=False)
    before = cache.k.clone()
    for bad_block in (NUM_BLOCKS, -1):
        attn.meta = attn.build_metadata([(0, 3, [bad_block], True)])
        x = torch.randn(3, HKV, D)
        with pytest.raises((IndexError, RuntimeError)):
            attn(0, torch.randn(3, HQ, D), x, x, 0.25)
    assert torch.equal(cache.k, before)
