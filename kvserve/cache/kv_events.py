"""What happens to the prefix cache, as events a router can follow: vLLM's `BlockStored`,
`BlockRemoved` and `AllBlocksCleared` (vllm/distributed/kv_events.py), the contract routers such
as llm-d and Dynamo consume (vLLM RFC #20492). The block pool records them as blocks join and
leave its prefix caches; the engine drains them each step and hands them to its publisher
(engine/kv_event_publisher.py), which sends them in vLLM's wire format.

Hashes are kvserve's block hashes (SHA-256 of the parent's hash and the block's tokens, salted
per tenant), so a consumer indexes what it is told and need not recompute them. `group_idx`
names the KV cache group of a hybrid model (None with one group, as vLLM omits it).
"""
from __future__ import annotations

from dataclasses import dataclass


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
