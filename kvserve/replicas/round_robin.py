"""Round robin over the replicas: the benchmark's baseline that reads no state."""
from __future__ import annotations

import itertools

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class RoundRobinRouter(RequestRouter):
    def initialize_state(self) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pin = pending_request.kwargs.get("pin") if pending_request is not None else None
        if pin is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        start = next(self._turn) % len(ordered)
        return [[r] for r in ordered[start:] + ordered[:start]]
