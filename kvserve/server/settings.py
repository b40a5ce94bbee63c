"""What the HTTP layer enforces, set once by `kvserve serve` (one dataclass, checked on construction)."""
from __future__ import annotations

from dataclasses import dataclass

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServerSettings:
    retry_after_s: int = 1
    model_name: str | None = None          # the id clients see; None: the engine's
    api_key: str | None = None             # every route but /health then needs "Authorization: Bearer <key>"
    expose_request_ids: bool = False       # /kv/state lists request ids (other clients' too) only if set
    allowed_hosts: tuple[str, ...] = _LOOPBACK  # Host header names accepted; ("*",): any
    max_request_bytes: int = 4 * 2**20     # bodies past this get 413

    def __post_init__(self) -> None:
        if self.retry_after_s < 0:
            raise ValueError(f"ServerSettings.retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"ServerSettings.max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerSettings.api_key must not be empty")
        if not self.allowed_hosts:
            raise ValueError("ServerSettings.allowed_hosts must name at least one host, or '*'")

    @staticmethod
    def hosts_for(bind: str, extra: str | None) -> tuple[str, ...]:
        """The Host names a server bound to `bind` answers to: loopback names for a loopback
        bind, the address itself otherwise, any for a wildcard bind; `extra` (comma-separated,
        '*' for any) replaces that."""
        if extra:
            return tuple(h.strip().lower() for h in extra.split(",") if h.strip())
        if bind in ("0.0.0.0", "::", ""):
            return ("*",)
        return _LOOPBACK if bind in _LOOPBACK else (bind.lower(),)

    def host_allowed(self, header: str | None) -> bool:
        if "*" in self.allowed_hosts:
            return True
        if not header:
            return False
        host = header.lower()
        if host.startswith("[") and "]" in host:  # "[::1]:8000" -> "::1"
            host = host[1:host.index("]")]
        elif host.count(":") == 1:  # "localhost:8000" -> "localhost"
            host = host.rsplit(":", 1)[0]
        return host in self.allowed_hosts
