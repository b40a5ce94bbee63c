"""The device blocks as the block manager hands them out: reference counts, one free queue in
eviction order, each KV cache group's prefix cache, and the sliding groups' null block.

A block that held nothing worth keeping goes to the front of the free queue, to be reused first;
a full block whose last user finished keeps its contents and its prefix hash and goes to the
back, so cached blocks are evicted least recently used first.

With `medium` set, every block that joins or leaves a prefix cache is recorded as a KV event
(cache/kv_events.py) until `take_events` drains them.
"""
from __future__ import annotations

from collections import OrderedDict

from kvserve.cache.blocks import Block
from kvserve.cache.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from kvserve.cache.kv_groups import NULL_BLOCK


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int, reserve_null: bool, medium: str | None = None) -> None:
        """`reserve_null`: a sliding group points its dropped table entries at `NULL_BLOCK`, which
        is then never handed out (reference count 1 for good). `medium`: the events' name for
        this pool's memory (None: no events recorded)."""
        self.medium = medium
        self.events: list[KVCacheEvent] = []
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.caches: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.reserved = int(reserve_null)
        if reserve_null:
            del self.free[NULL_BLOCK]
            self.blocks[NULL_BLOCK].ref_count = 1

    @property
    def capacity(self) -> int:
        """Blocks sequences can be given (all but a reserved null block)."""
        return len(self.blocks) - self.reserved

    @property
    def used(self) -> int:
        return self.capacity - len(self.free)

    def owned(self, block_id: int) -> bool:
        """Whether a table entry names a block it holds a reference to (not the null block)."""
        return block_id != NULL_BLOCK or not self.reserved

    def uncache(self, block: Block) -> None:
        del self.caches[block.group][block.hash]
        if self.medium is not None:
            self.events.append(BlockRemoved([block.hash], self.medium, self._group_idx(block.group)))
        block.hash, block.token_ids = None, ()

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def _group_idx(self, group: int) -> int | None:
        return group if len(self.caches) > 1 else None

    def forget(self, block_id: int) -> None:
        """Drop an unowned block from the prefix cache; it is then reused before cached ones."""
        self.uncache(self.blocks[block_id])
        self.free.move_to_end(block_id, last=False)

    def take(self) -> int:
        block_id = next(iter(self.free))
        if self.blocks[block_id].hash is not None:  # evict: its contents are about to be overwritten
            self.forget(block_id)
        del self.free[block_id]
        self.blocks[block_id].ref_count = 1
        return block_id

    def share(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)

    def cached(self, group: int, h: bytes, chunk: tuple[int, ...]) -> int | None:
        """The block group `group` caches under `h`, if it holds exactly `chunk` (a hash collision
        cannot alias)."""
        block_id = self.caches[group].get(h)
        return None if block_id is None or self.blocks[block_id].token_ids != chunk else block_id

    def register(self, group: int, block_id: int, h: bytes, chunk: tuple[int, ...], parent: bytes | None) -> bool:
        """Caches the block under `h` (whose parent block is cached under `parent`) in `group`,
        unless it or a live twin already is; returns whether it joined."""
        block = self.blocks[block_id]
        if block.hash is not None:
            return False
        cache = self.caches[group]
        twin = cache.get(h)
        if twin is not None and self.blocks[twin].ref_count == 0:
            # Two sequences computed the same block; keep the live copy cached, so the entry
            # survives the unowned twin's eviction. The twin becomes a plain free block.
            self.forget(twin)
            twin = None
        if twin is not None:
            return False
        block.hash, block.token_ids, block.group = h, chunk, group
        cache[h] = block_id
        if self.medium is not None:
            self.events.append(BlockStored([h], parent, list(chunk), len(chunk), self.medium, self._group_idx(group)))
        return True
