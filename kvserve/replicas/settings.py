"""How `kvserve serve --replicas` runs its replicas: checked on construction, importable without Ray."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

ROUTERS = ("prefix", "prefix-events", "power-of-two", "round-robin")
ROUTER_CLASSES = {"prefix": "kvserve.replicas.router:PrefixAwareRouter",
                  "prefix-events": "kvserve.replicas.router:EventPrefixRouter",
                  "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
                  "round-robin": "kvserve.replicas.round_robin:RoundRobinRouter"}


@dataclass(frozen=True)
class ReplicaSettings:
    num_replicas: int = 2
    router: str = "prefix"              # one of ROUTERS; power-of-two is Ray Serve's default; prefix-events
    #                                     follows each replica's KV events (its snapshots the fallback)
    stats_period_s: float = 1.0         # how often replicas publish their blocks to the router
    threads_per_replica: int | None = None  # torch threads each (default: the cores / replicas)
    # The address the HTTP server binds: a local Ray cluster takes it as its node's address, so a
    # loopback server's Ray listens on loopback alone (ReplicaFront.start).
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"ReplicaSettings.num_replicas must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"ReplicaSettings.router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if not self.stats_period_s > 0:
            raise ValueError(f"ReplicaSettings.stats_period_s must be > 0, got {self.stats_period_s}")


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
