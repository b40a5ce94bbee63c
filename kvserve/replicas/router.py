"""Prefix-aware routing on Ray Serve's RequestRouter API (SGLang's cache-aware router and Ray's
PrefixCacheAffinityRouter are the models).

Each replica publishes the keys of the blocks in its prefix cache (`record_routing_stats`); the
router adds the blocks of every request it routes since (the replica will hold them once the
prompt runs), so two requests with a new shared prefix sent before the next publication still
meet. A request goes to the replica holding the longest run of its prompt's blocks, unless the
queues are out of balance by more than `imbalance` requests, or no replica holds at least
`min_match` of them: then to the replica where the longest routed run of its blocks last went,
if that run covers `min_match` of them (a prefix every replica evicted comes back where it was,
rather than to both), else to the shortest queue, a random one of equals (so requests with
nothing cached spread). Equal matches go to the shorter queue.

`EventPrefixRouter` (`prefix-events`) reads what each replica holds from its KV events
(event_index.py) instead: a block evicted between two snapshots stops attracting requests at
once. Its guesses for routed blocks last until the events say the replica stored them; a replica
whose stream is not synced is judged by its snapshot.
"""
from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from kvserve.replicas.block_keys import matched_blocks
from kvserve.replicas.event_index import EventIndex

_AFFINITY_KEPT = 65_536  # routed block keys whose last replica is remembered


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 8, min_match: float = 0.1) -> None:
        self.imbalance, self.min_match = imbalance, min_match
        self._routed: dict[ReplicaID, set[str]] = {}       # keys sent there since its last publication
        self._published: dict[ReplicaID, list[str]] = {}   # its last published keys, to spot a new one
        self._last: OrderedDict[str, ReplicaID] = OrderedDict()  # routed block key -> where it last went
        self.decisions = {"prefix": 0, "affinity": 0, "balance": 0, "pinned": 0}

    def _held(self, replica: RunningReplica) -> set[str]:
        published = (replica.routing_stats or {}).get("blocks", [])
        if self._published.get(replica.replica_id) is not published:  # a new publication supersedes our guesses
            self._published[replica.replica_id] = published
            self._routed[replica.replica_id] = set()
        return set(published) | self._routed.get(replica.replica_id, set())

    def _queue(self, replica: RunningReplica) -> int:
        cached = self._replica_queue_len_cache.get(replica.replica_id)
        return cached if cached is not None else (replica.routing_stats or {}).get("queue", 0)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pin = kwargs.get("pin")
        if pin is not None:  # a call for one replica (its metrics, its pool)
            self.decisions["pinned"] += 1
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
        keys = kwargs.get("block_keys") or []
        queues = {r.replica_id: self._queue(r) for r in candidate_replicas}
        by_queue = sorted(candidate_replicas, key=lambda r: (queues[r.replica_id], random.random()))
        balanced = max(queues.values(), default=0) - min(queues.values(), default=0) <= self.imbalance
        if keys and balanced:
            match = {r.replica_id: matched_blocks(keys, self._held(r)) for r in candidate_replicas}
            best = max(match.values(), default=0)
            if best >= max(1, self.min_match * len(keys)):
                self.decisions["prefix"] += 1
                ranked = sorted(candidate_replicas, key=lambda r: (-match[r.replica_id], queues[r.replica_id]))
                return [[r] for r in ranked]
            # Keys are chain hashes: the deepest one routed before names the longest routed run.
            depth = next((i for i in range(len(keys) - 1, -1, -1) if keys[i] in self._last), -1)
            last = self._last[keys[depth]] if depth + 1 >= max(1, self.min_match * len(keys)) else None
            if last in queues:
                self.decisions["affinity"] += 1
                return [[r] for r in sorted(by_queue, key=lambda r: r.replica_id != last)]
        self.decisions["balance"] += 1
        return [[r] for r in by_queue]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        keys = pending_request.kwargs.get("block_keys")
        if keys:
            self._routed.setdefault(replica_id, set()).update(keys)
            for key in keys:
                self._last[key] = replica_id
                self._last.move_to_end(key)
            while len(self._last) > _AFFINITY_KEPT:
                self._last.popitem(last=False)


class EventPrefixRouter(PrefixAwareRouter):
    def initialize_state(self, imbalance: int = 8, min_match: float = 0.1) -> None:
        super().initialize_state(imbalance, min_match)
        self.events = EventIndex()

    def _held(self, replica: RunningReplica) -> set[str]:
        snapshot = super()._held(replica)  # also forgets guesses older than the last snapshot
        feed = (replica.routing_stats or {}).get("events")
        if not feed:
            return snapshot
        topic = feed["topic"]
        self.events.watch(topic, feed["endpoint"], feed["replay"])
        held = self.events.held(topic)
        if held is None:
            return snapshot
        routed = self._routed.setdefault(replica.replica_id, set())
        routed -= self.events.stored(topic, routed)  # stored since: the events say whether it still holds them
        return held | routed
