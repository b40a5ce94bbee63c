"""What each replica's prefix cache holds, followed from its KV events (engine/kv_event_publisher.py):
the router's index for `prefix-events` routing (router.py).

One SUB socket follows every replica, each under its own topic (its replica id). A replica first
seen is caught up through its replay socket from batch 0 (its `AllBlocksCleared`), then followed
live; a gap in a topic's sequence numbers (a dropped message, a slow subscriber) is filled the
same way, once the next message shows it (a lost last batch waits for the replica's next one).
A replica whose replay no longer reaches back to where the index needs it (its buffer wrapped)
is not synced, and `held` returns None: the router then falls back to the snapshots the replicas
publish. One thread owns the sockets; the router reads copies under a lock.

A replica holds a block while any of its own media does (its device pool, or its disk tier, read
back much faster than a prefill); a shared medium (Redis, kv_events.SHARED_MEDIA) is ignored,
since every replica reads it alike. What the index keeps is bounded: a removed key leaves the
held sets at once, so they hold what the replicas' caches hold, and joins a list of the last
`removed_kept` keys each replica dropped, which only settles the router's guesses (`stored`: a
block stored and evicted between two routing calls was stored all the same).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from typing import Any

from kvserve.cache.kv_events import SHARED_MEDIA
from kvserve.replicas.block_keys import block_key

logger = logging.getLogger(__name__)
_REPLAY_TIMEOUT_MS = 2000
_REMOVED_KEPT = 65_536  # per replica: as many as the router's affinity keeps of routed keys


class EventIndex:
    def __init__(self, removed_kept: int = _REMOVED_KEPT) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, dict[str | None, set[str]]] = {}  # topic -> medium -> keys of the blocks there
        self._removed: dict[str, OrderedDict[str, None]] = {}  # topic -> keys none of its media holds, newest last
        self._removed_kept = removed_kept
        self._synced: set[str] = set()
        self._next: dict[str, int] = {}         # topic -> the sequence number it expects next
        self._replay: dict[str, str] = {}
        self._watches: queue.Queue[tuple[str, str, str] | None] = queue.Queue()
        self._known: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="kvserve-event-index", daemon=True)
        self._thread.start()

    def watch(self, topic: str, endpoint: str, replay: str) -> None:
        """Follow the replica publishing `topic` at `endpoint` (a no-op once it is followed)."""
        if topic not in self._known:
            self._known.add(topic)
            self._watches.put((topic, endpoint, replay))

    def held(self, topic: str) -> set[str] | None:
        """The keys of the blocks the replica holds, or None while its stream is not synced."""
        with self._lock:
            return set().union(*self._held.get(topic, {}).values()) if topic in self._synced else None

    def stored(self, topic: str, keys: set[str]) -> set[str]:
        """Those of `keys` the replica holds or dropped lately (among the last `removed_kept`): the
        router's guesses settle on them. Costs the size of `keys`, on every routing call."""
        with self._lock:
            media = self._held.get(topic, {}).values()
            removed = self._removed.get(topic, {})
            return {key for key in keys if key in removed or any(key in held for held in media)}

    def close(self) -> None:
        self._watches.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import msgpack
        import zmq

        self._unpack = msgpack.unpackb
        context = zmq.Context.instance()
        sub = context.socket(zmq.SUB)
        try:
            while True:
                while not self._watches.empty():
                    watch = self._watches.get()
                    if watch is None:
                        return
                    topic, endpoint, replay = watch
                    sub.connect(endpoint)
                    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
                    self._replay[topic] = replay
                    self._catch_up(context, topic, 0)
                if not sub.poll(50):
                    continue
                raw_topic, raw_seq, payload = sub.recv_multipart()
                topic, seq = raw_topic.decode(), int.from_bytes(raw_seq, "big")
                if topic not in self._next or seq < self._next[topic]:
                    continue  # before the replica's catch-up ended: already applied
                if seq > self._next[topic]:
                    self._catch_up(context, topic, self._next[topic])
                if seq == self._next.get(topic):
                    self._apply(topic, seq, payload)
        finally:
            sub.close(linger=0)

    def _catch_up(self, context: Any, topic: str, start: int) -> None:
        """Asks the replica's replay socket for every batch from `start`; synced if they all came."""
        import zmq

        dealer = context.socket(zmq.DEALER)
        dealer.connect(self._replay[topic])
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        first = None
        try:
            while dealer.poll(_REPLAY_TIMEOUT_MS):
                _, raw_seq, payload = dealer.recv_multipart()
                seq = int.from_bytes(raw_seq, "big", signed=True)
                if seq < 0:
                    break
                first = seq if first is None else first
                if seq >= self._next.get(topic, start):
                    self._apply(topic, seq, payload)
            else:
                logger.warning("kvserve: replica %s's KV event replay did not answer", topic)
        finally:
            dealer.close(linger=0)
        with self._lock:
            if first == start or (first is None and topic in self._synced):
                self._synced.add(topic)
            else:
                self._synced.discard(topic)
        self._next.setdefault(topic, start)

    def _apply(self, topic: str, seq: int, payload: bytes) -> None:
        batch = self._unpack(payload, raw=False)
        with self._lock:
            media = self._held.setdefault(topic, {})
            removed = self._removed.setdefault(topic, OrderedDict())
            for event in batch["events"]:
                kind = event["type"]
                if kind == "AllBlocksCleared":
                    for held in media.values():
                        self._forget(removed, held)
                    media.clear()
                elif event.get("group_idx") in (None, 0) and event.get("medium") not in SHARED_MEDIA:
                    # The full-attention group is what a hit needs.
                    keys = {block_key(h) for h in event["block_hashes"]}
                    held = media.setdefault(event.get("medium"), set())
                    if kind == "BlockStored":
                        held |= keys
                        for key in keys:
                            removed.pop(key, None)
                    elif kind == "BlockRemoved":
                        held -= keys
                        self._forget(removed, {key for key in keys if not any(key in h for h in media.values())})
        self._next[topic] = seq + 1

    def _forget(self, removed: OrderedDict[str, None], keys: set[str]) -> None:
        """Keys no medium of the replica holds any more: kept a while for `stored`, the oldest going."""
        for key in keys:
            removed[key] = None
            removed.move_to_end(key)
        while len(removed) > self._removed_kept:
            removed.popitem(last=False)
