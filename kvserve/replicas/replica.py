"""One engine as a Ray Serve replica: the same AsyncEngine the single-process server runs,
reached through Ray instead of in-process calls.

Methods take keyword arguments the router reads and the replica ignores: `block_keys` (the
prompt's full blocks, for prefix affinity) and `pin` (a replica id: calls meant for one replica,
such as its metrics). `record_routing_stats` is Ray Serve's hook: the router receives what it
returns every `request_routing_stats_period_s`, here the keys of every block in this replica's
prefix cache and its queue, so the router's view follows blocks stored and evicted.
"""
from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.replicas.block_keys import block_key
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import AsyncEngine, Done
from kvserve.server.metrics import Metrics
from kvserve.server.startup_heap import freeze_startup_heap


@dataclass(frozen=True)
class Accepted:
    """The first item of every stream: which replica (Serve's id, its process) took the request."""
    replica: str
    pid: int


@dataclass(frozen=True)
class ReplicaDescription:
    tokenizer: Any
    model_name: str
    max_model_len: int
    block_size: int


def routing_view(engine: LLMEngine) -> dict[str, Any]:
    """Runs on the engine thread: the blocks a new prompt could hit here, the queue, and where its
    KV events are published (the `prefix-events` router follows them)."""
    sched = engine.scheduler
    view: dict[str, Any] = {"blocks": [block_key(h) for h in engine.block_manager.cache],
                            "queue": len(sched.running) + len(sched.waiting)}
    events = engine.config.kv_events
    if events.kv_events_publisher == "zmq":
        view["events"] = {"topic": events.kv_events_topic, "endpoint": events.kv_events_endpoint,
                          "replay": events.kv_events_replay_endpoint}
    return view


def _bind_serve_grpc_to_node_address() -> None:
    """Serve gives each replica a gRPC server for calls between deployments (kvserve's handle
    calls replicas as Ray actors instead), bound to every interface ("[::]:0", fixed in Ray 2.60)
    whatever the Ray node's address. Serve reaches it at that address, so it listens there alone:
    on loopback when kvserve keeps Ray there (front._start_ray)."""
    import ray
    from ray._common.network_utils import build_address
    from ray.serve._private import replica as serve_replica

    add_port = serve_replica.add_port_to_grpc_server
    address = build_address(ray.util.get_node_ip_address(), 0)
    serve_replica.add_port_to_grpc_server = lambda server, wanted: add_port(
        server, address if wanted == "[::]:0" else wanted)


def with_kv_events(config: EngineConfig, replica_id: str) -> EngineConfig:
    """The replica's config publishing its KV events under its id, on ports of its own at the Ray
    node's address (loopback when kvserve keeps Ray there)."""
    import ray

    from kvserve.net import free_loopback_port

    host = ray.util.get_node_ip_address()
    pub, replay = (f"tcp://{host if host.startswith('127.') else '*'}:{free_loopback_port()}" for _ in range(2))
    return config.replace(kv_events_publisher="zmq", kv_events_endpoint=pub, kv_events_replay_endpoint=replay,
                          kv_events_topic=replica_id)


class EngineReplica:
    def __init__(self, config: EngineConfig, max_waiting: int, threads: int, kv_events: bool = False) -> None:
        """`kv_events`: publish this replica's KV events for the `prefix-events` router."""
        from ray import serve

        _bind_serve_grpc_to_node_address()  # before Serve starts it, once this returns
        torch.set_num_threads(threads)  # replicas share the machine's cores
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = LLMEngine(with_kv_events(config, replica_id) if kv_events else config)
        self.aengine = AsyncEngine(self.engine, Metrics(), max_waiting)
        self.aengine.start()
        freeze_startup_heap()
        self.tag = Accepted(replica_id, os.getpid())

    def describe(self, pin: str | None = None) -> ReplicaDescription:
        e = self.engine
        return ReplicaDescription(e.tokenizer, e.model_name, e.max_model_len, e.config.cache.block_size)

    async def generate(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                       cache_salt: str | None = None, block_keys: list[str] | None = None) -> AsyncIterator[Any]:
        """`Accepted`, then the AsyncEngine's items (RequestOutputs, exceptions, one Done per
        request). Bad input, a full queue or draining raise before anything is yielded. A caller
        that cancels the stream (its client left) aborts what is still running."""
        ids, sink = await self.aengine.submit(prompts, params, request_id, cache_salt)
        pending = set(ids)
        try:
            yield self.tag
            while pending:
                item = await sink.get()
                if isinstance(item, Done):
                    pending.discard(item.request_id)
                yield item
        finally:
            if pending:
                self.aengine.abort(sorted(pending))

    async def record_routing_stats(self) -> dict[str, Any]:
        return await self.aengine.call(routing_view)

    async def metrics_text(self, pin: str | None = None) -> bytes:
        return await self.aengine.metrics_text()

    async def kv_state(self, expose_request_ids: bool, pin: str | None = None) -> dict[str, Any]:
        return await self.aengine.kv_state(expose_request_ids)

    async def counters(self, pin: str | None = None) -> dict[str, Any]:
        """Prefix-cache and compute totals, for benchmarks and tests."""
        def read(e: LLMEngine) -> dict[str, Any]:
            return {"replica": self.tag.replica, "pid": self.tag.pid, "tokens_computed": e.tokens_computed,
                    **asdict(e.block_manager.prefix_stats)}
        return await self.aengine.call(read)

    def __del__(self) -> None:
        self.aengine.shutdown(timeout=0)
