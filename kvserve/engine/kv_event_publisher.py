"""Publishes the KV events of the prefix cache and the tier below it (cache/kv_events.py) as vLLM's
`ZmqEventPublisher` does, so that a client written against vLLM's event schema reads ours.

Each step's events go out as one batch: a ZeroMQ multipart message (topic, sequence number as 8
bytes big-endian, payload), the payload a msgpack map `{ts, events, data_parallel_rank}` whose
events are maps tagged by `type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) with vLLM's
field names. The last `buffer_steps` batches are kept: a subscriber that joins late sends a
sequence number (8 bytes big-endian) to the ROUTER replay socket and gets every kept batch from
there on as (sequence, payload) frames, then (-1, empty). The first batch is `AllBlocksCleared`:
an engine starts with an empty cache, so a router drops what it knew of this endpoint.

A thread of its own owns the sockets (ZeroMQ sockets are not thread-safe) and sends what the
engine's step queued; the step never waits for the network.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from typing import Any

from kvserve.cache.kv_events import AllBlocksCleared, KVCacheEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_map(event: KVCacheEvent) -> dict[str, Any]:
    """One event as vLLM's msgspec struct encodes it (tagged, defaults omitted; lora fields None)."""
    fields = {k: v for k, v in dataclasses.asdict(event).items() if not (k == "group_idx" and v is None)}
    if "token_ids" in fields:
        fields |= {"lora_id": None, "lora_name": None}
    return {"type": type(event).__name__, **fields}


class ZmqEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, buffer_steps: int, topic: str) -> None:
        import msgpack
        import zmq

        self._packb = msgpack.packb
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        # A stable address is bound, a volatile one connected to (vLLM's rule); a loopback address
        # is bound too, since only this machine can be there (and a subscriber does not listen).
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://", "tcp://127.",
                                                                        "tcp://localhost:")):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[list[KVCacheEvent] | None] = queue.Queue()
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVCacheEvent]) -> None:
        self._queue.put(events)

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = self._packb({"ts": time.time(), "events": [event_map(e) for e in events],
                                   "data_parallel_rank": 0}, use_bin_type=True)
            seq = self._next_seq
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # (client, empty delimiter, start): anything else is no request
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
