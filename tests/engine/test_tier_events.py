"""Issue 45's acceptance for KV events, tiers included: after a seeded random workload on a pool and
a disk tier small enough to evict, the engine's whole event stream (asked of its replay socket,
decoded with vLLM's schema) replayed into one set per medium equals the device pool's prefix cache
and the disk tier's files; every removal names a block stored before. A restarted engine's stream
announces what its directory kept. With the Redis tier, the REDIS set equals the keys the engine
wrote (nothing is evicted there)."""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from kvserve import LLM, SamplingParams
from kvserve.cache.blocks import block_hash
from kvserve.cache.kv_events import DISK, REDIS
from kvserve.net import free_loopback_port
from tests.conftest import RedisServer
from tests.engine.test_kv_event_publisher import DECODER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BLOCK = 4


def events_llm(tiny_llm: Callable[..., LLM], **tier: Any) -> LLM:
    pub, replay = f"tcp://127.0.0.1:{free_loopback_port()}", f"tcp://127.0.0.1:{free_loopback_port()}"
    return tiny_llm(kv_events_publisher="zmq", kv_events_endpoint=pub, kv_events_replay_endpoint=replay,
                    kv_events_topic="kv", block_size=BLOCK, kv_cache_memory="96KiB", **tier)


def history(llm: LLM) -> list[KVEventBatch]:
    """Every batch the engine published, from its first, through the replay socket. Asked once the
    publisher's queue is empty: its one thread then serves the request after whatever batch it was
    sending, so the answer holds them all (an idle engine queues no more)."""
    publisher = llm.engine.kv_events
    for _ in range(100):
        if publisher._queue.empty():
            break
        time.sleep(0.05)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(llm.engine.config.kv_events.kv_events_replay_endpoint)
    batches: list[KVEventBatch] = []
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert sock.poll(5000), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return batches
            assert int.from_bytes(seq, "big") == len(batches)  # from batch 0, none missing
            batches.append(DECODER.decode(payload))
    finally:
        sock.close(linger=0)


def replay(batches: list[KVEventBatch]) -> tuple[dict[str, set[bytes]], dict[str, int]]:
    """One set of block hashes per medium, and how many blocks each medium removed."""
    held: dict[str, set[bytes]] = {}
    removed: dict[str, int] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                held.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                media = held.setdefault(event.medium, set())
                assert set(event.block_hashes) <= media, f"{event.medium} removed a block it never stored"
                media.difference_update(event.block_hashes)
                removed[event.medium] = removed.get(event.medium, 0) + len(event.block_hashes)
    return held, removed


def disk_files(llm: LLM) -> set[bytes]:
    return {bytes.fromhex(p.name.removesuffix(".kvb")) for p in llm.engine.remote.dir.glob("*.kvb")}


def workload(llm: LLM, rng: random.Random, rounds: int, damage: bool = False) -> None:
    """Prompts over more shared prefixes than the pool keeps, with random tails and lengths, in
    batches. With `damage`, between batches a prefix's first block, evicted from the pool but on
    disk, may get a flipped byte: the next prompt on that prefix reads it from disk."""
    prefixes = [[rng.randrange(4, 120) for _ in range(rng.randrange(8, 24))] for _ in range(8)]
    for _ in range(rounds):
        prompts = [rng.choice(prefixes) + [rng.randrange(4, 120) for _ in range(rng.randrange(1, 30))]
                   for _ in range(rng.randrange(1, 5))]
        params = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        if not damage:
            continue
        firsts = [block_hash(None, tuple(prefix[:BLOCK])) for prefix in prefixes]
        cold = [h for h in firsts if h not in llm.engine.block_manager.cache and h in disk_files(llm)]
        if cold and rng.random() < 0.5:
            path = llm.engine.remote.dir / (rng.choice(cold).hex() + ".kvb")
            data = bytearray(path.read_bytes())
            data[rng.randrange(len(data))] ^= 0x40
            path.write_bytes(bytes(data))


def test_replayed_events_equal_the_pool_and_the_disk_tier(tiny_llm: Callable[..., LLM], tmp_path: Path) -> None:
    rng = random.Random(45)
    disk = {"kv_disk_dir": str(tmp_path), "kv_disk_memory": "160KiB"}  # 78 blocks of this model, the pool 48
    llm = events_llm(tiny_llm, **disk)
    device = llm.engine.block_manager.pool.medium
    workload(llm, rng, 30, damage=True)
    held, removed = replay(history(llm))
    assert held.keys() == {device, DISK}
    assert held[device] == set(llm.engine.block_manager.cache) and held[device]
    assert held[DISK] == disk_files(llm) == {bytes.fromhex(n[:-4]) for n in llm.engine.remote._files}
    stats = llm.engine.remote.stats
    # Both evicted, and the disk skipped a damaged file, read from disk (hits) in between: all said so.
    assert removed[device] > 0 and removed[DISK] > stats.corrupt > 0 and stats.hits > 0
    llm.engine.close()

    # A restart on the directory: the stream starts empty, then names every block the disk kept.
    again = events_llm(tiny_llm, **disk)
    first = history(again)
    assert first[0].events == [AllBlocksCleared()]
    assert replay(first)[0] == {DISK: disk_files(again)} and disk_files(again)
    workload(again, rng, 10)
    held, _ = replay(history(again))
    assert again.engine.remote.stats.hits > 0  # prefixes came back from disk into the pool
    assert held[DISK] == disk_files(again) and held[device] == set(again.engine.block_manager.cache)
    again.engine.close()


def test_the_redis_tier_announces_what_it_wrote(tiny_llm: Callable[..., LLM], redis_server: RedisServer) -> None:
    llm = events_llm(tiny_llm, kv_remote=redis_server.url)
    workload(llm, random.Random(7), 12)
    held, removed = replay(history(llm))
    keys = {bytes.fromhex(k.decode().rsplit(":", 1)[1]) for k in redis_server.client.keys("kvserve:*")}
    assert held[REDIS] == keys and keys and REDIS not in removed
    assert held[llm.engine.block_manager.pool.medium] == set(llm.engine.block_manager.cache)
    llm.engine.close()
