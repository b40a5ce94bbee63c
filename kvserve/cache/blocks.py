"""The block manager's vocabulary: a block, its prefix hash, a prompt's grant, an offloaded
(host) block's id, and the usage counters the metrics read."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockUsage:
    total: int
    used: int               # blocks with at least one owner
    free: int               # unowned blocks holding nothing reusable
    cached: int             # unowned full blocks kept for prefix reuse (evictable)
    tokens: int             # slots holding a token, in used blocks
    allocated_slots: int    # slots in used blocks
    unshared_blocks: int    # blocks the block tables would need without sharing
    offloaded: int = 0      # host blocks holding cold blocks of long sequences

    @property
    def waste(self) -> float:
        """Fraction of allocated slots that hold no token."""
        return 1 - self.tokens / self.allocated_slots if self.allocated_slots else 0.0


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None        # set once the block is full and registered in the cache
    group: int = 0                   # the KV cache group whose prefix cache holds `hash`
    token_ids: tuple[int, ...] = ()  # compared on every hit, so a hash collision cannot alias


def block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """A full block is named by its tokens and everything before them (its parent's hash)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(",".join(map(str, token_ids)).encode())
    return digest.digest()


def salt_root(salt: str | None) -> bytes | None:
    """The parent hash of a salted sequence's first block: sequences with different salts never
    share a cached block, so one tenant cannot learn from hits what another one sent."""
    return None if salt is None else hashlib.sha256(b"cache_salt:" + salt.encode()).digest()


@dataclass
class PrefixStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # not computed: found in the pool, or in the remote tier
    remote_tokens: int = 0  # of those, loaded from the remote tier

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class PromptGrant:
    """A prompt's blocks were given: how many of its tokens need no computing, and the blocks the
    remote tier serves, to be loaded before the step runs."""
    cached: int                                # tokens in the pool, or arriving with `loads`
    loads: tuple[tuple[int, bytes], ...] = ()  # (device block, its pages from the remote tier)


class HostBlock(int):
    """A table entry that lives in host memory: an offloaded block. Its value is the id kernels
    address it by (the device pool's size + `host_index`), so block tables stay plain integer
    tensors; Python code asks `isinstance(b, HostBlock)` instead of comparing ids."""
    host_index: int

    def __new__(cls, host_index: int, num_device_blocks: int) -> "HostBlock":
        block = super().__new__(cls, num_device_blocks + host_index)
        block.host_index = host_index
        return block


def on_device(block_id: int) -> bool:
    return not isinstance(block_id, HostBlock)
