"""What happens to the prefix cache, as events a router can follow: vLLM's `BlockStored`,
`BlockRemoved` and `AllBlocksCleared` (vllm/distributed/kv_events.py), the contract routers such
as llm-d and Dynamo consume (vLLM RFC #20492). The block pool records them as blocks join and
leave its prefix caches; the engine drains them each step and hands them to its publisher
(engine/kv_event_publisher.py), which sends them in vLLM's wire format.

Hashes are kvserve's block hashes (SHA-256 of the parent's hash and the block's tokens, salted
per tenant), so a consumer indexes what it is told and need not recompute them. `group_idx`
names the KV cache group of a hybrid model (None with one group, as vLLM omits it).

`medium` says where a block is: the device pool's name (vLLM's "GPU"; "CPU" for an engine on a
CPU), or a lower tier's, `DISK` (kv_disk.py) or `REDIS` (kv_remote.py). A lower tier records its
events in `TierEvents`, in the shape vLLM's offloading connector gives its own tier's: the block
hashes alone (no parent, no tokens), since the device pool's `BlockStored` for the same hash
carried them. A consumer keeps a set per medium; a block in two media is in two sets. The host
memory below the device (offload and swap, swap_space.py) holds running or preempted sequences'
blocks, never a prefix cache's (no hash finds them there), so it has no medium.
"""
from __future__ import annotations

from dataclasses import dataclass

DISK = "DISK"
REDIS = "REDIS"
SHARED_MEDIA = frozenset({REDIS})
"""Media every engine on the same store reads: a block there says nothing of where to route."""


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class TierEvents:
    """What a lower tier gained and dropped since `take`, in order, under its medium."""

    def __init__(self, medium: str, block_size: int) -> None:
        """`block_size`: tokens per block (vLLM's field; the tier itself knows only bytes)."""
        self.medium, self.block_size = medium, block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, hashes: list[bytes]) -> None:
        if hashes:
            self._events.append(BlockStored(list(hashes), None, [], self.block_size, self.medium))

    def removed(self, hashes: list[bytes]) -> None:
        if hashes:
            self._events.append(BlockRemoved(list(hashes), self.medium))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
