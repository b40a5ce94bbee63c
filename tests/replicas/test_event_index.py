"""The router's event index against a real publisher (no Ray): a replica joined late is caught up
through the replay socket, then followed live; one whose replay buffer no longer reaches back is
not trusted (the router falls back to snapshots); a block is held while one of the replica's own
media holds it; removed keys are forgotten, all but a bounded few kept to settle guesses."""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from kvserve.cache.blocks import block_hash
from kvserve.cache.kv_events import DISK, REDIS, AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.engine.kv_event_publisher import ZmqEventPublisher
from kvserve.net import free_loopback_port
from kvserve.replicas.block_keys import block_key
from kvserve.replicas.event_index import EventIndex

HASHES = [block_hash(None, (i,)) for i in range(6)]
KEYS = [block_key(h) for h in HASHES]


def publisher(buffer_steps: int = 100) -> tuple[ZmqEventPublisher, str, str]:
    pub, replay = f"tcp://127.0.0.1:{free_loopback_port()}", f"tcp://127.0.0.1:{free_loopback_port()}"
    return ZmqEventPublisher(pub, replay, buffer_steps, "r1"), pub, replay


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.02)
    return False


def stored(i: int, medium: str = "CPU") -> BlockStored:
    return BlockStored([HASHES[i]], None, [i], 1, medium)


def test_a_replica_joined_late_is_caught_up_then_followed() -> None:
    pub, endpoint, replay = publisher()
    index = EventIndex()
    try:
        pub.publish([stored(0), stored(1)])
        pub.publish([BlockRemoved([HASHES[0]], "CPU")])
        time.sleep(0.2)  # sent before anyone listens: only the replay has them
        index.watch("r1", endpoint, replay)
        assert eventually(lambda: index.held("r1") == {KEYS[1]})
        time.sleep(0.3)  # the subscription reaches the publisher
        pub.publish([stored(2), BlockRemoved([HASHES[1]], "CPU")])
        assert eventually(lambda: index.held("r1") == {KEYS[2]})
        assert index.stored("r1", set(KEYS)) == {KEYS[0], KEYS[1], KEYS[2]}
        assert index.held("r2") is None  # a replica never seen: no stream to trust
    finally:
        index.close()
        pub.close()


def test_removed_keys_are_forgotten_all_but_the_last_few() -> None:
    """Stored then removed, over and over: the held set follows, and of the removed keys only the
    last `removed_kept` still settle a guess; a key stored again leaves that list."""
    pub, endpoint, replay = publisher()
    index = EventIndex(removed_kept=2)
    try:
        index.watch("r1", endpoint, replay)
        assert eventually(lambda: index.held("r1") == set())
        time.sleep(0.3)
        pub.publish([stored(i) for i in range(6)])
        pub.publish([BlockRemoved([HASHES[i]], "CPU") for i in range(5)])
        assert eventually(lambda: index.held("r1") == {KEYS[5]})
        assert index.stored("r1", set(KEYS)) == {KEYS[3], KEYS[4], KEYS[5]}  # 0..2 forgotten
        pub.publish([stored(3), BlockRemoved([HASHES[0]], "CPU")])  # 0 was forgotten: a removal is news still
        assert eventually(lambda: index.held("r1") == {KEYS[3], KEYS[5]})
        assert index.stored("r1", set(KEYS)) == {KEYS[0], KEYS[3], KEYS[4], KEYS[5]}
        pub.publish([AllBlocksCleared()])  # a restart: everything removed, the last two kept
        assert eventually(lambda: index.held("r1") == set())
        assert len(index.stored("r1", set(KEYS))) == 2
    finally:
        index.close()
        pub.close()


def test_a_block_is_held_while_one_of_the_replicas_own_media_holds_it() -> None:
    """On the device and the disk: held until both dropped it. In Redis alone: not held (every
    replica reads Redis alike), nor stored."""
    pub, endpoint, replay = publisher()
    index = EventIndex()
    try:
        index.watch("r1", endpoint, replay)
        assert eventually(lambda: index.held("r1") == set())
        time.sleep(0.3)
        pub.publish([stored(0), stored(0, DISK), stored(1), stored(2, REDIS)])
        assert eventually(lambda: index.held("r1") == {KEYS[0], KEYS[1]})
        pub.publish([BlockRemoved([HASHES[0]], "CPU"), BlockRemoved([HASHES[1]], "CPU")])
        assert eventually(lambda: index.held("r1") == {KEYS[0]})  # still on disk
        pub.publish([BlockRemoved([HASHES[0]], DISK)])
        assert eventually(lambda: index.held("r1") == set())
        assert index.stored("r1", set(KEYS)) == {KEYS[0], KEYS[1]}
    finally:
        index.close()
        pub.close()


def test_a_replay_that_no_longer_reaches_back_is_not_trusted() -> None:
    pub, endpoint, replay = publisher(buffer_steps=2)
    index = EventIndex()
    try:
        for i in range(4):  # batches 0 (AllBlocksCleared) .. 4: only the last two are kept
            pub.publish([stored(i)])
        time.sleep(0.2)
        index.watch("r1", endpoint, replay)
        time.sleep(1.0)
        assert index.held("r1") is None
    finally:
        index.close()
        pub.close()


def test_the_event_router_forgets_an_evicted_block_before_the_next_snapshot() -> None:
    """A replica's stale snapshot names a block it evicted since; the events router does not, and
    its guess for a routed prompt lasts until the events say the block was stored, then follows them."""
    import importlib.util
    from types import SimpleNamespace

    import pytest
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray[serve] is not installed (pip install 'kvserve[ray]')")
    # Importing the router imports Ray, which reads this once: as replicas.front sets it for a
    # loopback cluster, so a later test in this process can still start one (test_replicas.py).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from kvserve.replicas.router import EventPrefixRouter

    pub, endpoint, replay = publisher()
    router = EventPrefixRouter.__new__(EventPrefixRouter)  # the state alone: Serve's plumbing is not needed
    router.initialize_state()
    stale = {"blocks": [KEYS[0], KEYS[1]], "queue": 0}
    replica = SimpleNamespace(replica_id="A", routing_stats={**stale, "events": {"topic": "r1", "endpoint": endpoint,
                                                                                 "replay": replay}})
    try:
        pub.publish([stored(0), stored(1), BlockRemoved([HASHES[0]], "CPU")])
        assert eventually(lambda: router._held(replica) == {KEYS[1]})  # not the snapshot's KEYS[0]
        router.on_request_routed(SimpleNamespace(kwargs={"block_keys": [KEYS[3]]}), "A", None)
        assert router._held(replica) == {KEYS[1], KEYS[3]}  # routed there: held once its prompt runs
        pub.publish([stored(3)])
        assert eventually(lambda: router._held(replica) == {KEYS[1], KEYS[3]} and
                          router.events.stored("r1", {KEYS[3]}) == {KEYS[3]})
        pub.publish([BlockRemoved([HASHES[3]], "CPU")])
        assert eventually(lambda: router._held(replica) == {KEYS[1]})  # evicted: the guess is gone too
        unsynced = SimpleNamespace(replica_id="B", routing_stats=stale)  # no events: its snapshot
        assert router._held(unsynced) == {KEYS[0], KEYS[1]}
    finally:
        router.events.close()
        pub.close()


def test_a_prefix_nobody_holds_goes_back_where_it_last_went() -> None:
    """Affinity: once both replicas report they hold nothing of a prompt, it goes to the replica its
    first block was last routed to, whichever queue is shorter (within the balance limit)."""
    import asyncio
    import importlib.util
    from types import SimpleNamespace

    import pytest
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray[serve] is not installed (pip install 'kvserve[ray]')")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # as in the test above
    from kvserve.replicas.router import PrefixAwareRouter

    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state()
    router._replica_queue_len_cache = {}
    a = SimpleNamespace(replica_id="A", routing_stats={"blocks": [], "queue": 3})
    b = SimpleNamespace(replica_id="B", routing_stats={"blocks": [], "queue": 0})
    request = SimpleNamespace(kwargs={"block_keys": KEYS[:3]})
    router.on_request_routed(request, "A", None)
    a.routing_stats = {"blocks": [], "queue": 3}  # a new report: A evicted it, nobody holds it
    ranked = asyncio.run(router.choose_replicas([a, b], request))
    assert [r[0].replica_id for r in ranked] == ["A", "B"] and router.decisions["affinity"] == 1
    fresh = SimpleNamespace(kwargs={"block_keys": KEYS[3:5]})  # never routed: the shorter queue
    assert asyncio.run(router.choose_replicas([a, b], fresh))[0][0].replica_id == "B"
    # Sharing only a first block (a chat template's preamble) is under min_match: no affinity.
    long_keys = [KEYS[0]] + [f"{i:016x}" for i in range(19)]
    assert asyncio.run(router.choose_replicas([a, b], SimpleNamespace(kwargs={"block_keys": long_keys})))[0][0] \
        .replica_id == "B"


def test_messages_the_subscriber_missed_are_filled_from_replay() -> None:
    """Batches lost on the way (every fifth, after the first ten, never reaches the subscriber but
    stays in the replay buffer): the sequence numbers show the gaps, the replay socket fills them,
    and the index ends as the publisher's history says."""
    pub, endpoint, replay = publisher(buffer_steps=1000)
    send = pub._pub.send_multipart

    def lossy(frames: tuple[bytes, bytes, bytes]) -> None:
        seq = int.from_bytes(frames[1], "big")
        if seq < 10 or seq % 5:
            send(frames)

    pub._pub.send_multipart = lossy
    index = EventIndex()
    catch_ups: list[int] = []  # where each replay request started
    replay_from = index._catch_up
    index._catch_up = lambda context, topic, start: (catch_ups.append(start), replay_from(context, topic, start))
    try:
        index.watch("r1", endpoint, replay)
        assert eventually(lambda: index.held("r1") == set())
        time.sleep(0.3)
        for i in range(60):  # store and remove blocks 0..5 over and over: the last word is the state
            pub.publish([stored(i % 6)] if i % 4 else [BlockRemoved([HASHES[i % 6]], "CPU")])
        want: set[str] = set()
        for i in range(60):
            (want.add if i % 4 else want.discard)(KEYS[i % 6])
        assert eventually(lambda: index.held("r1") == want, timeout_s=10)
        assert catch_ups[0] == 0 and len(catch_ups) > 1  # joined from batch 0, then filled the gaps
    finally:
        index.close()
        pub.close()
