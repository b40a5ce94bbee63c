"""A KV tier shared by every engine that can reach one Redis (or Valkey) server (`kv_remote`).

Full prefix blocks are stored when they join the prefix cache and fetched on a local prefix
miss, so a replica with a cold cache reuses blocks another replica computed (LMCache's idea,
on an existing store). An entry is keyed by the engine's namespace (model fingerprint, page
formats, block size, rotation, layout version, tensor-parallel rank) and the block's chain hash,
which names the block's tokens and everything before them. Its value is a magic tag, a tag over
the key and the pages, and the pages: a value of another length, or under another key than the
one it was written for (another block's, another namespace's), fails the check, is counted in
`stats.corrupt` and treated as a miss.

Without a secret the tag is a checksum, which anyone who can write to the Redis server can
compute for pages of their choosing: the tier trusts every writer of that server. With `secret`
(EngineConfig.kv_remote_secret) it is a keyed BLAKE2b, a MAC only holders of the secret can make,
and the namespace's digest in the keys is keyed too, so engines with other secrets (or none)
share no key at all.

The tier never fails a request: a connection error or a reply slower than `timeout_s` logs a
warning, counts in `stats.errors`, and turns the tier off for `retry_after_s` (every lookup a
miss, every store dropped), after which it tries again. What it would have served is computed.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 2
_MAGIC = b"KVS2"
_TAG = 32  # blake2b digest bytes of a value's tag
_HEADER = len(_MAGIC) + _TAG


@dataclass
class RemoteStats:
    """Counters since the start, for /metrics and tests."""
    lookups: int = 0       # blocks asked for
    hits: int = 0          # blocks served
    stored: int = 0        # blocks written
    corrupt: int = 0       # values that failed their tag or length (corrupted, forged, or under another key)
    errors: int = 0        # connection errors and timeouts


def shown_url(url: str) -> str:
    """`url` as logs may show it: a password (redis://user:secret@host, ?password=secret) masked."""
    url = re.sub(r"([?&])password=[^&#]*", r"\1password=***", url)
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))


class RemoteKVTier:
    """Blocks as bytes in Redis, through redis-py."""

    def __init__(self, url: str, namespace: str, block_bytes: int, timeout_s: float = 0.25,
                 retry_after_s: float = 10.0, secret: str | None = None) -> None:
        """`block_bytes`: a block's pages (block_bytes.block_nbytes); a value of another length is
        corrupt, whatever its tag says. `secret`: makes the tag a MAC (kept here only as the
        BLAKE2b key derived from it, never logged)."""
        import redis  # only engines with a tier need it

        self.url, self.namespace, self.block_bytes = shown_url(url), namespace, block_bytes
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        # blake2b takes a key of at most 64 bytes: a digest of the secret fits any secret. An empty
        # key is plain (unkeyed) BLAKE2b.
        self._mac_key = b"" if secret is None else hashlib.blake2b(secret.encode(), digest_size=32).digest()
        ns_digest = hashlib.blake2b(namespace.encode(), digest_size=16, key=self._mac_key).digest()
        self._prefix = f"kvserve:{ns_digest.hex()}:".encode()
        self.stats = RemoteStats()
        self._down_until = 0.0
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def key(self, block_hash: bytes) -> bytes:
        return self._prefix + block_hash.hex().encode()

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
        payload = value[_HEADER:]
        if (len(payload) != self.block_bytes or value[:len(_MAGIC)] != _MAGIC
                or not hmac.compare_digest(value[len(_MAGIC):_HEADER], self._tag(block_hash, payload))):
            self.stats.corrupt += 1
            return None
        return payload

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
