"""Property tests of the paged block pool and the prefix cache."""
from hypothesis import given, settings, strategies as st

from ecoserve.kv.block_pool import BlockPool, NoFreeBlocksError
from ecoserve.kv.manager import KVCacheManager
from ecoserve.request import Request
from ecoserve.sampling import SamplingParams

import pytest


def _check_invariants(pool: BlockPool, held: dict[int, int]) -> None:
    for block in pool.blocks:
        assert block.ref_cnt == held.get(block.block_id, 0)
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "touch"]), st.integers(0, 6)), max_size=60))
def test_pool_refcounts_and_no_leaks(ops):
    pool = BlockPool(16)
    owners: list[list] = []
    held: dict[int, int] = {}
    for op, n in ops:
        if op == "alloc":
            if n > pool.num_free_blocks:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n)
                continue
            blocks = pool.allocate(n)
            assert len({b.block_id for b in blocks}) == n
            assert all(held.get(b.block_id, 0) == 0 for b in blocks)  # never hand out a held block
            owners.append(blocks)
        elif op == "touch" and owners:
            blocks = owners[n % len(owners)]
            pool.touch(blocks)
            owners.append(list(blocks))
        elif op == "free" and owners:
            blocks = owners.pop(n % len(owners))
            pool.free(blocks[::-1])
            for b in blocks:
                held[b.block_id] -= 1
            continue
        else:
            continue
        for b in owners[-1]:
            held[b.block_id] = held.get(b.block_id, 0) + 1
        _check_invariants(pool, held)
    for blocks in owners:
        pool.free(blocks)
    assert pool.num_free_blocks == pool.num_blocks


def test_double_free_is_detected():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])


def test_lru_order_allocates_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.free([b]); pool.free([a]); pool.free([c])
    assert [x.block_id for x in pool.allocate(3)] == [b.block_id, a.block_id, c.block_id]


def _req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), 0.0)


def _compute(mgr, req):
    """Pretend the whole request was computed (what the scheduler does after a step)."""
    cached = mgr.get_computed_blocks(req)
    req.num_computed_tokens = 0
    assert mgr.allocate_slots(req, req.num_tokens - len(cached) * mgr.block_size, cached)
    req.num_computed_tokens = req.num_tokens
    mgr.cache_blocks(req, req.num_tokens)
    return cached


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1, max_size=8))
def test_prefix_hits_only_for_identical_prefixes(prompts):
    bs = 4
    mgr = KVCacheManager(num_blocks=64, block_size=bs)
    done = []
    for i, tokens in enumerate(prompts):
        req = _req(str(i), tokens)
        cached = _compute(mgr, req)
        hit_tokens = len(cached) * bs
        assert hit_tokens <= len(tokens) - 1
        # every hit block holds exactly this prompt's tokens at that position
        for k, block in enumerate(cached):
            assert block.token_ids == tuple(tokens[k * bs:(k + 1) * bs])
        # and a longest identical full-block prefix among earlier (still cached) prompts is found
        best = 0
        for prev in done:
            common = 0
            while common < min(len(prev), len(tokens) - 1) and prev[common] == tokens[common]:
                common += 1
            best = max(best, common // bs * bs)
        assert hit_tokens == min(best, (len(tokens) - 1) // bs * bs)
        done.append(tokens)
        mgr.free(req)
    assert mgr.num_free_blocks == 64


def test_allocation_failure_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    big = _req("a", range(17))
    assert not mgr.allocate_slots(big, 17)
    assert mgr.num_free_blocks == 4 and mgr.block_ids("a") == []


def test_shared_prefix_blocks_are_reference_counted():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a, b = _req("a", range(9)), _req("b", list(range(8)) + [99])
    _compute(mgr, a)
    cached = _compute(mgr, b)
    assert [blk.block_id for blk in cached] == mgr.block_ids("a")[:2]
    assert all(blk.ref_cnt == 2 for blk in cached)
    mgr.free(a)
    assert all(blk.ref_cnt == 1 for blk in cached)
    mgr.free(b)
    assert mgr.num_free_blocks == 8
    assert mgr.prefix_hits == 8
