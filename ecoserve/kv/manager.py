"""Per-request block tables over the block pool, with prefix caching."""
from __future__ import annotations

from ecoserve.kv.block_pool import BlockPool, KVBlock, chain_hash
from ecoserve.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}  # kept in step with _blocks: block tables without rebuilding
        self._num_cached: dict[str, int] = {}  # leading blocks of the request already in the prefix index
        self._pins: set[str] = set()  # requests whose KV outlives a stop at their token limit (FuDG export)
        self._held: dict[str, list[KVBlock]] = {}  # pinned or imported blocks that no running request owns
        self.prefix_queries = 0  # tokens looked up (vLLM's prefix_cache_queries counts tokens)
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def owned_blocks(self) -> dict[str, list[KVBlock]]:
        """Request id -> the blocks it holds; read-only, for the scheduler's per-decode fit check."""
        return self._blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: valid until its blocks next change)."""
        return self._block_ids.get(request_id, [])

    def block_tables(self, request_ids) -> dict[str, list[int]]:
        """`block_ids` of each request, as one dict (built once per step)."""
        get = self._block_ids.get
        return {rid: get(rid, []) for rid in request_ids}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, req: Request) -> list[KVBlock]:
        """Longest chain of cached full blocks within the request's first num_tokens - 1 tokens.

        One token is always left to compute so that the step produces logits to sample from.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        bs, tokens = self.block_size, req.all_token_ids
        hits: list[KVBlock] = []
        parent: KVBlock | None = None
        root = req.lora_id or None  # the chain starts from the adapter: two adapters never share a block
        for start in range(0, (req.num_tokens - 1) // bs * bs, bs):
            ids = tuple(tokens[start:start + bs])
            block = self.pool.lookup(chain_hash(parent.block_hash if parent else root, ids), ids, parent, root)
            if block is None:
                break
            hits.append(block)
            parent = block
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * bs
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[KVBlock] = ()) -> bool:
        """Make room for `num_new_tokens` after the computed ones; False (and no change) if it won't fit."""
        owned = self._blocks.get(req.request_id)
        if owned is None:
            owned = self._blocks[req.request_id] = []
        elif not computed and req.num_computed_tokens + num_new_tokens <= len(owned) * self.block_size:
            return True  # fits in the blocks it has (most decode steps)
        ids = self._block_ids.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(owned) - len(computed)
        revived = sum(1 for b in computed if b.ref_cnt == 0)
        if max(need, 0) + revived > self.pool.num_free_blocks:
            if not owned:
                del self._blocks[req.request_id], self._block_ids[req.request_id]
            return False
        if computed:
            self.pool.touch(list(computed))
            owned.extend(computed)
            self._num_cached[req.request_id] = len(computed)
        if need > 0:
            owned.extend(self.pool.allocate(need))
        ids.extend(b.block_id for b in owned[len(ids):])
        return True

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Index the request's full blocks among its first `num_tokens` tokens.

        Called when a chunk is scheduled: the blocks it completes are written during this step's
        forward pass, before any attention reads them (each layer writes all new KV first), so a
        request admitted later in the same step may share them.
        """
        if not self.enable_prefix_caching:
            return
        owned = self._blocks.get(req.request_id)
        if not owned:
            return
        bs = self.block_size
        done = self._num_cached.get(req.request_id, 0)
        full = min(num_tokens // bs, len(owned))
        root = req.lora_id or None
        for i in range(done, full):
            ids = tuple(req.all_token_ids[i * bs:(i + 1) * bs])
            parent = owned[i - 1] if i else None
            parent_hash = parent.block_hash if parent else root
            if i and parent_hash is None:
                break  # parent not indexed (its content is owned by another canonical block)
            self.pool.cache(owned[i], chain_hash(parent_hash, ids), ids, parent, root)
            if owned[i].block_hash is None:
                break
            done = i + 1
        self._num_cached[req.request_id] = done

    def free(self, req: Request, uncomputed_from: int | None = None, keep: bool = False) -> None:
        """Release the request's blocks; those from token `uncomputed_from` on leave the prefix index.

        A request preempted in the step that scheduled it never computes the blocks indexed for
        that step, so they must not serve later hits, nor may another request already hold them.
        `keep` (a finish at the token limit) holds the blocks of a pinned request for
        `held_block_ids` / `release` instead.
        """
        rid = req.request_id
        if uncomputed_from is None and rid in self._pins:  # finished: the pin ends here
            self._pins.discard(rid)
            if keep and rid in self._blocks:
                self._held[rid] = self._blocks.pop(rid)
                self._block_ids.pop(rid, None)
                self._num_cached.pop(rid, None)
                return
        blocks = self._blocks.get(rid)
        uncomputed = blocks[uncomputed_from // self.block_size:] if blocks and uncomputed_from is not None else []
        shared = [b.block_id for b in uncomputed if b.ref_cnt > 1]
        if shared:
            # Another request hit these blocks this step and would read KV that nobody writes: a
            # policy must preempt before it admits (the built-in ones do).
            raise AssertionError(f"request {rid!r} is preempted while other requests share its "
                                 f"not yet computed blocks {shared}")
        self._blocks.pop(rid, None)
        self._block_ids.pop(req.request_id, None)
        self._num_cached.pop(req.request_id, None)
        if not blocks:
            return
        for block in uncomputed:
            self.pool.uncache(block)
        self.pool.free(blocks[::-1])

    # ---- KV that moves between instances (FuDG) ------------------------------------------
    def pin(self, request_id: str) -> None:
        """Keep the request's blocks when it stops at its token limit, for an export."""
        self._pins.add(request_id)

    def held_block_ids(self, request_id: str) -> list[int] | None:
        blocks = self._held.get(request_id)
        return None if blocks is None else [b.block_id for b in blocks]

    def release(self, request_id: str) -> bool:
        """Free held blocks (exported, or an import nobody claimed); False if none were held."""
        self._pins.discard(request_id)
        blocks = self._held.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks[::-1])
        return True

    def import_blocks(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Fresh blocks for `num_tokens` tokens of KV arriving from elsewhere; None if they do not fit."""
        need = self.blocks_needed(num_tokens)
        if request_id in self._held or request_id in self._blocks or need > self.pool.num_free_blocks:
            return None
        self._held[request_id] = self.pool.allocate(need)
        return [b.block_id for b in self._held[request_id]]

    def adopt(self, req: Request, num_tokens: int) -> bool:
        """Give a queued request its imported blocks: its first `num_tokens` tokens count as computed."""
        blocks = self._held.get(req.request_id)
        if blocks is None or len(blocks) * self.block_size < num_tokens or req.request_id in self._blocks:
            return False
        del self._held[req.request_id]
        self._blocks[req.request_id] = blocks
        self._block_ids[req.request_id] = [b.block_id for b in blocks]
        req.num_computed_tokens = num_tokens
        return True
