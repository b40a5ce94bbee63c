"""The remote KV tier against a real redis-server: round trips, checks, and faults."""
from __future__ import annotations

import hashlib
import threading
import time

import pytest
import redis
import torch

from kvserve.cache.block_bytes import read_blocks, write_blocks
from kvserve.cache.formats import make_format
from kvserve.cache.kv_events import REDIS, BlockStored, TierEvents
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.kv_remote import RemoteKVTier
from kvserve.cache.quantized_pool import QuantizedKVPool
from tests.conftest import RedisServer

HASHES = [bytes([i]) * 32 for i in range(4)]
PAYLOADS = [bytes(range(i, i + 100)) for i in range(4)]


def test_stored_blocks_come_back_in_order_up_to_the_first_miss(redis_server: RedisServer) -> None:
    tier = RemoteKVTier(redis_server.url, "model-a", 100)
    tier.store(list(zip(HASHES[:2], PAYLOADS[:2])) + [(HASHES[3], PAYLOADS[3])])
    assert tier.fetch(HASHES) == PAYLOADS[:2]  # the third is missing: the fourth cannot extend a prefix
    assert (tier.stats.lookups, tier.stats.hits, tier.stats.stored) == (4, 2, 3)
    assert RemoteKVTier(redis_server.url, "model-b", 100).fetch(HASHES) == []  # another namespace, other keys


def test_events_announce_what_the_server_acknowledged(redis_server: RedisServer) -> None:
    """Every block of an acknowledged store, the ones another engine wrote first included; nothing
    for a store the server never took, and no removal (Redis does not say what it drops)."""
    events = TierEvents(REDIS, 16)
    tier = RemoteKVTier(redis_server.url, "model-a", 100, events=events)
    RemoteKVTier(redis_server.url, "model-a", 100).store([(HASHES[0], PAYLOADS[0])])  # another engine's
    tier.store(list(zip(HASHES[:2], PAYLOADS[:2])))
    assert events.take() == [BlockStored(HASHES[:2], None, [], 16, REDIS)]
    redis_server.client.flushdb()
    assert tier.fetch(HASHES[:2]) == [] and events.take() == []
    redis_server.stop()
    tier.store([(HASHES[2], PAYLOADS[2])])
    assert tier.stats.errors == 1 and events.take() == []


def test_a_corrupted_or_foreign_entry_is_ignored_and_counted(redis_server: RedisServer) -> None:
    tier = RemoteKVTier(redis_server.url, "model-a", 100)
    tier.store(list(zip(HASHES, PAYLOADS)))
    value = bytearray(redis_server.client.get(tier.key(HASHES[1])))
    value[-1] ^= 1  # one flipped bit of the payload
    redis_server.client.set(tier.key(HASHES[1]), bytes(value))
    assert tier.fetch(HASHES) == PAYLOADS[:1] and tier.stats.corrupt == 1
    # An entry another namespace wrote, put under this namespace's key (a version or model change
    # that kept the key): its checksum covers the other namespace's key.
    other = RemoteKVTier(redis_server.url, "model-a-layout-2", 100)
    redis_server.client.set(tier.key(HASHES[0]), other.pack(HASHES[0], PAYLOADS[0]))
    assert tier.fetch(HASHES) == [] and tier.stats.corrupt == 2


def test_a_value_is_bound_to_its_key(redis_server: RedisServer) -> None:
    """Each value intact, but under another block's key: the checksum covers the key (namespace
    and chain hash) with the pages, so both are rejected."""
    tier = RemoteKVTier(redis_server.url, "model-a", 100)
    tier.store(list(zip(HASHES, PAYLOADS)))
    client = redis_server.client
    client.mset({tier.key(HASHES[2]): client.get(tier.key(HASHES[3])),
                 tier.key(HASHES[3]): client.get(tier.key(HASHES[2]))})
    assert tier.fetch(HASHES) == PAYLOADS[:2] and tier.stats.corrupt == 1
    assert tier.fetch(HASHES[3:]) == [] and tier.stats.corrupt == 2


def test_with_a_secret_only_its_holders_write_values_it_takes(redis_server: RedisServer) -> None:
    """A keyed MAC (BLAKE2b keyed by a digest of the secret): under the right key, a value made
    without the secret or with another one fails it; made with it (the control), it passes.
    Engines with different secrets use different keys altogether."""
    tier = RemoteKVTier(redis_server.url, "model-a", 100, secret="s3cret")
    plain = RemoteKVTier(redis_server.url, "model-a", 100)
    assert tier.key(HASHES[0]) != plain.key(HASHES[0])
    tier.store(list(zip(HASHES, PAYLOADS)))
    assert tier.fetch(HASHES) == PAYLOADS and plain.fetch(HASHES) == []
    key = tier.key(HASHES[0])
    for secret, taken in ((b"", False), (b"guess", False), (b"s3cret", True)):
        mac_key = hashlib.blake2b(secret, digest_size=32).digest() if secret else b""
        tag = hashlib.blake2b(key + PAYLOADS[0], digest_size=32, key=mac_key).digest()
        redis_server.client.set(key, b"KVS2" + tag + PAYLOADS[0])
        assert tier.fetch(HASHES[:1]) == (PAYLOADS[:1] if taken else []), secret
    assert tier.stats.corrupt == 2


def test_a_payload_of_another_length_is_corrupt(redis_server: RedisServer) -> None:
    """A value whose header and checksum are right but whose pages are not a block's length (the
    tier knows a block's bytes) is counted and ends the run, like a flipped bit."""
    tier = RemoteKVTier(redis_server.url, "model-a", 100)
    tier.store(list(zip(HASHES, PAYLOADS)))
    redis_server.client.set(tier.key(HASHES[1]), tier.pack(HASHES[1], PAYLOADS[1][:10]))
    assert tier.fetch(HASHES) == PAYLOADS[:1] and tier.stats.corrupt == 1


def test_writing_bytes_of_another_layout_is_refused() -> None:
    pool = KVPool(2, 6, 4, 2, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="10 bytes"):
        write_blocks(pool.block_tensors, [(0, bytes(10))])


def test_a_dead_server_costs_a_warning_and_a_miss_then_the_tier_comes_back(redis_server: RedisServer,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    tier = RemoteKVTier(redis_server.url, "m", 100, retry_after_s=0.5)
    tier.store(list(zip(HASHES, PAYLOADS)))
    redis_server.stop()
    assert tier.fetch(HASHES) == [] and tier.stats.errors == 1
    assert "computing instead" in caplog.text and not tier.available
    tier.store(list(zip(HASHES, PAYLOADS)))  # dropped without another attempt while off
    assert tier.stats.errors == 1
    redis_server.start()  # the same port again, empty
    time.sleep(0.5)
    tier.store(list(zip(HASHES, PAYLOADS)))
    assert tier.fetch(HASHES) == PAYLOADS and tier.stats.errors == 1


def test_a_password_in_the_url_never_reaches_the_log(caplog: pytest.LogCaptureFixture) -> None:
    """The tier's warnings name its server: not its password (user:pw@ or ?password=)."""
    for url in ("redis://kv:hunter2@127.0.0.1:1/0", "redis://127.0.0.1:1/0?password=hunter2"):
        tier = RemoteKVTier(url, "m", 100, timeout_s=0.05)
        assert tier.fetch(HASHES) == [] and tier.stats.errors == 1  # nothing listens on port 1
        assert "127.0.0.1:1" in caplog.text and "hunter2" not in caplog.text and "***" in caplog.text


def test_a_slow_server_times_out_instead_of_stalling_the_step(redis_server: RedisServer) -> None:
    tier = RemoteKVTier(redis_server.url, "m", 100, timeout_s=0.2)
    tier.store(list(zip(HASHES, PAYLOADS)))
    sleeper = threading.Thread(target=lambda: redis.Redis.from_url(redis_server.url).execute_command("DEBUG", "SLEEP", 1.5))
    sleeper.start()
    time.sleep(0.1)
    start = time.perf_counter()
    got = tier.fetch(HASHES)
    waited = time.perf_counter() - start
    sleeper.join()
    assert got == [] and tier.stats.errors == 1
    assert waited < 1.0  # the timeout, not the server's 1.5 s stall


@pytest.mark.parametrize("fmt", ["auto", "int8", "int4"])
def test_a_blocks_bytes_rebuild_it_in_another_pool(fmt: str) -> None:
    def pool() -> KVPool | QuantizedKVPool:
        if fmt == "auto":
            return KVPool(2, 6, 4, 2, 16, torch.bfloat16, torch.device("cpu"))
        formats = [(make_format(fmt, "k", group_size=8), make_format(fmt, "v", group_size=8))] * 2
        return QuantizedKVPool(6, 4, 2, 16, torch.bfloat16, torch.device("cpu"), formats, 0, 0)

    src, dst = pool(), pool()
    g = torch.Generator().manual_seed(0)
    for t in src.block_tensors:
        t.copy_(torch.randint(0, 100, t.shape, generator=g).to(t.dtype) if t.dtype == torch.uint8
                else torch.randn(t.shape, generator=g).to(t.dtype))
    write_blocks(dst.block_tensors, list(zip([5, 0], read_blocks(src.block_tensors, [1, 3]))))
    for s, d in zip(src.block_tensors, dst.block_tensors):
        assert torch.equal(d[5].view(torch.uint8), s[1].view(torch.uint8))
        assert torch.equal(d[0].view(torch.uint8), s[3].view(torch.uint8))
        assert not d[1].view(torch.uint8).any()  # nothing else written
