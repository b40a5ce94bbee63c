"""What every lower tier of full prefix blocks shares (the Redis tier, kv_remote.py; the disk
tier, kv_disk.py): a namespace, and a sealed value per block that proves it holds the pages it
was written for.

A value is a magic tag, a tag over the entry's key and the pages, and the pages. The key names the
namespace (model fingerprint, page formats, block size, rotation, layout version,
tensor-parallel rank: engine/remote_namespace.py) and the block's chain hash, so a value of
another length, or under another key than the one it was written for (another block's, another
namespace's, a torn or flipped write), fails the check, is counted in `stats.corrupt` and is
treated as a miss. Without a secret the tag is a checksum; with one it is a keyed BLAKE2b (a MAC),
and the namespace's digest is keyed too.

With `events` (kv_events.TierEvents), a tier records the blocks it gains and drops, for the KV
event publisher (engine/kv_event_publisher.py); each subclass says how much of that it can know.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from kvserve.cache.kv_events import TierEvents

LAYOUT_VERSION = 2
_MAGIC = b"KVS2"
_TAG = 32  # blake2b digest bytes of a value's tag
HEADER = len(_MAGIC) + _TAG


@dataclass
class TierStats:
    """Counters since the start, for /metrics and tests."""
    lookups: int = 0        # blocks asked for
    hits: int = 0           # blocks served
    stored: int = 0         # blocks written
    corrupt: int = 0        # values that failed their tag or length (corrupted, truncated, forged, foreign)
    errors: int = 0         # failed calls: connection errors and timeouts, a full or unwritable disk
    bytes_read: int = 0     # pages served
    bytes_written: int = 0  # pages stored


class BlockTier:
    def __init__(self, namespace: str, block_bytes: int, secret: str | None = None,
                 events: TierEvents | None = None) -> None:
        """`block_bytes`: a block's pages (block_bytes.block_nbytes); a value of another length is
        corrupt, whatever its tag says. `secret`: makes the tag a MAC (kept here only as the
        BLAKE2b key derived from it, never logged). `events`: where to record KV events (None:
        none recorded)."""
        self.namespace, self.block_bytes, self.events = namespace, block_bytes, events
        # blake2b takes a key of at most 64 bytes: a digest of the secret fits any secret. An empty
        # key is plain (unkeyed) BLAKE2b.
        self._mac_key = b"" if secret is None else hashlib.blake2b(secret.encode(), digest_size=32).digest()
        self.namespace_digest = hashlib.blake2b(namespace.encode(), digest_size=16, key=self._mac_key).hexdigest()
        self.stats = TierStats()

    def key(self, block_hash: bytes) -> bytes:
        """The entry's name in the tier (fixed length per namespace)."""
        raise NotImplementedError

    @property
    def available(self) -> bool:
        """Whether the tier takes lookups and stores now."""
        raise NotImplementedError

    def fetch(self, hashes: list[bytes]) -> list[bytes]:
        """Payloads of the longest run of `hashes`, from the first, that the tier holds intact."""
        raise NotImplementedError

    def store(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """(chain hash, payload) pairs to keep; an entry already there is left as it is."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the tier holds open (nothing, unless a subclass says)."""

    def _stored(self, hashes: list[bytes]) -> None:
        if self.events is not None:
            self.events.stored(hashes)

    def _removed(self, hashes: list[bytes]) -> None:
        if self.events is not None:
            self.events.removed(hashes)

    def _tag(self, block_hash: bytes, payload: bytes) -> bytes:
        """Over the key (the namespace's digest and the chain hash: a fixed length, so the two
        parts cannot shift) and the pages."""
        return hashlib.blake2b(self.key(block_hash) + payload, digest_size=_TAG, key=self._mac_key).digest()

    def pack(self, block_hash: bytes, payload: bytes) -> bytes:
        return _MAGIC + self._tag(block_hash, payload) + payload

    def unpack(self, block_hash: bytes, value: bytes | None) -> bytes | None:
        """The payload of the value stored under `block_hash`'s key, or None when absent; a value
        that fails its checks is counted and treated as absent."""
        if value is None:
            return None
        payload = value[HEADER:]
        if (len(payload) != self.block_bytes or value[:len(_MAGIC)] != _MAGIC
                or not hmac.compare_digest(value[len(_MAGIC):HEADER], self._tag(block_hash, payload))):
            self.stats.corrupt += 1
            return None
        return payload
