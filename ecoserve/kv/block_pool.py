"""Paged KV block pool: reference counts, an O(1) LRU free list, and a prefix-cache index.

A block whose reference count drops to zero stays in the prefix-cache index (its KV is still
valid) but sits in the free list; allocation takes the least recently freed block and evicts
its cache entry then. Hits are verified against the block's own token ids and its parent block,
so a hash collision can never serve KV computed for other tokens.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: "KVBlock | None" = None
    parent_hash: int | None = None

    def clear_cache_entry(self) -> None:
        self.block_hash = self.token_ids = self.parent = self.parent_hash = None


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full block that also commits to every block before it."""
    return hash((parent_hash, token_ids))


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self.uncache(block)  # evict: its KV is about to be overwritten
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits (reviving them from the free list if needed)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; pass a request's blocks tail first so tails are evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: KVBlock | None,
               root: int | None = None) -> KVBlock | None:
        """`root`: what a first block's chain starts from (a LoRA adapter's id; None for the base model)."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent is not parent:
            return None
        if block.parent_hash != (root if parent is None else parent.block_hash):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...], parent: KVBlock | None,
              root: int | None = None) -> None:
        """Register a full, computed block; the first block with given content stays the canonical one."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        block.parent, block.parent_hash = parent, (parent.block_hash if parent else root)
        self._cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Take the block out of the prefix index (it stays allocated or free as it was)."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.clear_cache_entry()
