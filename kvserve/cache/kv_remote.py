"""A KV tier shared by every engine that can reach one Redis (or Valkey) server (`kv_remote`).

Full prefix blocks are stored when they join the prefix cache and fetched on a local prefix
miss, so a replica with a cold cache reuses blocks another replica computed (LMCache's idea,
on an existing store). An entry is keyed by the engine's namespace and the block's chain hash,
and sealed as block_tier.py describes: a value that fails its check is a counted miss.

Without a secret the tag is a checksum, which anyone who can write to the Redis server can
compute for pages of their choosing: the tier trusts every writer of that server. With `secret`
(EngineConfig.kv_remote_secret) it is a keyed BLAKE2b, a MAC only holders of the secret can make,
and the namespace's digest in the keys is keyed too, so engines with other secrets (or none)
share no key at all.

The tier never fails a request: a connection error or a reply slower than `timeout_s` logs a
warning, counts in `stats.errors`, and turns the tier off for `retry_after_s` (every lookup a
miss, every store dropped), after which it tries again. What it would have served is computed.

Its KV events (medium `REDIS`, kv_events.py) say only what this engine knows: a `BlockStored` for
each block of a store the server acknowledged (written now, or already there from another engine).
No `BlockRemoved` ever follows: Redis drops keys on its own (maxmemory eviction, a flush, another
client's delete, a restart without persistence) and tells no one, and a lookup's miss cannot tell
a dropped block from one never stored without keeping every key announced. So a consumer reads
REDIS events as "written at some point", an upper bound of what the server holds; since every
engine on the server reads it, the router does not route by them (kv_events.SHARED_MEDIA).
"""
from __future__ import annotations

import logging
import re
import time
from urllib.parse import urlsplit, urlunsplit

from kvserve.cache.block_tier import BlockTier
from kvserve.cache.kv_events import TierEvents

logger = logging.getLogger(__name__)


def shown_url(url: str) -> str:
    """`url` as logs may show it: a password (redis://user:secret@host, ?password=secret) masked."""
    url = re.sub(r"([?&])password=[^&#]*", r"\1password=***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))


class RemoteKVTier(BlockTier):
    """Blocks as bytes in Redis, through redis-py."""

    def __init__(self, url: str, namespace: str, block_bytes: int, timeout_s: float = 0.25,
                 retry_after_s: float = 10.0, secret: str | None = None, events: TierEvents | None = None) -> None:
        """`block_bytes`, `secret`, `events`: as BlockTier's."""
        import redis  # only engines with a tier need it

        super().__init__(namespace, block_bytes, secret, events)
        self.url = shown_url(url)
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._down_until = 0.0
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def key(self, block_hash: bytes) -> bytes:
        return b"kvserve:" + self.namespace_digest.encode() + b":" + block_hash.hex().encode()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, err: Exception) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.retry_after_s
        logger.warning("kvserve: KV tier %s %s failed (%s: %s); computing instead, retrying in %.0f s",
                       self.url, what, type(err).__name__, err, self.retry_after_s)

    def fetch(self, hashes: list[bytes]) -> list[bytes]:
        """Payloads of the longest run of `hashes`, from the first, that the tier holds intact."""
        if not hashes or not self.available:
            return []
        self.stats.lookups += len(hashes)
        try:
            values = self._client.mget([self.key(h) for h in hashes])
        except Exception as err:  # redis-py raises its own ConnectionError / TimeoutError, OSError below
            self._failed("lookup", err)
            return []
        out = []
        for block_hash, value in zip(hashes, values):
            payload = self.unpack(block_hash, value)
            if payload is None:
                break
            out.append(payload)
        self.stats.hits += len(out)
        self.stats.bytes_read += sum(map(len, out))
        return out

    def store(self, blocks: list[tuple[bytes, bytes]]) -> None:
        """(chain hash, payload) pairs; an entry already there is left as it is (same name, same
        content), so replicas computing the same block write it once."""
        if not blocks or not self.available:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash, payload in blocks:
                pipe.set(self.key(block_hash), self.pack(block_hash, payload), nx=True)
            pipe.execute()
        except Exception as err:
            self._failed("store", err)
            return
        self.stats.stored += len(blocks)
        self.stats.bytes_written += sum(len(payload) for _, payload in blocks)
        self._stored([block_hash for block_hash, _ in blocks])
