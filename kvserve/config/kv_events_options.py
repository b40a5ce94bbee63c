"""The KV events part of the configuration, as vLLM's `KVEventsConfig`: whether and where the
engine publishes what joins and leaves its prefix cache and lower tier (cache/kv_events.py), for routers."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.config.options import Options, opt

KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsOptions(Options):
    kv_events_publisher: str = opt("null", "publish the KV events of the prefix cache and of kv_disk_dir or "
                                           "kv_remote in vLLM's format (msgpack BlockStored / BlockRemoved / "
                                           "AllBlocksCleared batches): zmq, or null for none",
                                   choices=KV_EVENT_PUBLISHERS)
    kv_events_endpoint: str = opt("tcp://*:5557", "zmq: the PUB socket's address (bound when it holds '*', is "
                                                  "loopback, ipc:// or inproc://, else connected to)")
    kv_events_replay_endpoint: str | None = opt(None, "zmq: a ROUTER address where a subscriber that joins late "
                                                      "asks for the batches from a sequence number on")
    kv_events_buffer_steps: int = opt(10_000, "zmq: the most recent batches kept for replay")
    kv_events_topic: str = opt("", "zmq: the topic frame of every message")

    def _check(self) -> None:
        self._one_of("kv_events_publisher", KV_EVENT_PUBLISHERS)
        self._positive("kv_events_buffer_steps")
