"""The names a router and the replicas agree on for a prompt's full blocks: each block's chain
hash (cache/block_manager.py), shortened to 16 hex digits (64 bits: a collision costs a wrong
routing guess, never a wrong output, since replicas check the tokens of every hit)."""
from __future__ import annotations

from collections.abc import Iterable

from kvserve.cache.block_manager import block_hash, salt_root

KEY_HEX = 16


def block_key(h: bytes) -> str:
    return h.hex()[:KEY_HEX]


def prompt_block_keys(token_ids: list[int], block_size: int, salt: str | None = None) -> list[str]:
    """Keys of the blocks a replica's prefix cache could serve for this prompt: the full blocks
    before its last token (which is always computed)."""
    keys, parent = [], salt_root(salt)
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        keys.append(block_key(parent))
    return keys


def matched_blocks(keys: list[str], held: Iterable[str] | set[str]) -> int:
    """How many of `keys`, from the first, a replica holding `held` has: a prefix run."""
    held = held if isinstance(held, set) else set(held)
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
