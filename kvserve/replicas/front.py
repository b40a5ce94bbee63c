"""`kvserve serve --replicas N`: N engines as one Ray Serve deployment, behind the same HTTP app.

The app talks to a `ReplicaFront` as it would to one AsyncEngine (server/front.py). Each request
becomes one streaming call on the deployment's handle; the handle's router (router.py) picks the
replica from the prompt's block keys. Replica failures end the request they were serving with an
error the app reports (a stream gets an error event); Serve restarts the replica, and the router
stops sending to it once Ray reports it dead.

Calls meant for every replica (metrics, the dashboard's pool) go to each by id (`pin`), ids read
from Ray's list of named actors (Serve names each replica's actor after its id).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from collections import OrderedDict
from typing import Any

from kvserve.config import EngineConfig
from kvserve.replicas.block_keys import prompt_block_keys
from kvserve.replicas.metrics_merge import merge_metrics
from kvserve.replicas.replica import Accepted, EngineReplica, ReplicaDescription
from kvserve.replicas.settings import ROUTER_CLASSES, ReplicaSettings, is_loopback
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import Done, request_ids
from kvserve.validate import FieldError

logger = logging.getLogger(__name__)

APP_NAME = "kvserve"
_CALL_TIMEOUT_S = 10.0
_SERVED_BY_KEPT = 10_000


class ReplicaFront:
    def __init__(self, handle: Any, description: ReplicaDescription) -> None:
        self.handle = handle
        self.tokenizer = description.tokenizer
        self.model_name = description.model_name
        self.max_model_len = description.max_model_len
        self.block_size = description.block_size
        # request id -> the replica that took it, for the most recent requests (logs, benchmarks)
        self.served_by: OrderedDict[str, Accepted] = OrderedDict()
        self._pumps: dict[str, tuple[asyncio.Task, asyncio.Queue]] = {}
        self._draining = False

    @classmethod
    def start(cls, config: EngineConfig, settings: ReplicaSettings, max_waiting: int) -> "ReplicaFront":
        """Starts Ray (a local cluster unless RAY_ADDRESS names one) and the deployment; returns
        once every replica has loaded its model."""
        _start_ray(settings.host)  # first: it sets what Ray reads when imported
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        # Our app is the HTTP ingress: Serve's own HTTP proxies are not started.
        serve.start(http_options={"location": "NoServer"})
        threads = settings.threads_per_replica or max(1, (os.cpu_count() or 1) // settings.num_replicas)
        deployment = serve.deployment(EngineReplica, name="EngineReplica").options(
            num_replicas=settings.num_replicas,
            max_ongoing_requests=max_waiting + config.scheduler.max_num_seqs,
            ray_actor_options={"num_cpus": 0},  # torch threads are set per replica instead
            request_router_config=RequestRouterConfig(
                request_router_class=ROUTER_CLASSES[settings.router],
                request_routing_stats_period_s=settings.stats_period_s))
        handle = serve.run(deployment.bind(config, max_waiting, threads, settings.router == "prefix-events"),
                           name=APP_NAME, route_prefix=None)
        return cls(handle, handle.describe.remote().result())

    @staticmethod
    def stop() -> None:
        from ray import serve
        serve.shutdown()

    # -- EngineFront ---------------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        self._draining = True

    async def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str,
                     cache_salt: str | None = None) -> tuple[list[str], asyncio.Queue]:
        from kvserve.server.async_engine import Draining
        if self._draining:
            raise Draining("the server is shutting down")
        keys = prompt_block_keys(prompts[0], self.block_size, cache_salt)
        stream = self.handle.options(stream=True).generate.remote(prompts, params, request_id, cache_salt,
                                                                  block_keys=keys)
        try:
            accepted = await stream.__anext__()  # bad input, a full queue: raised here, as AsyncEngine does
        except Exception as err:
            raise _unwrap(err) from None
        ids = request_ids(request_id, len(prompts))
        for rid in ids:
            self.served_by[rid] = accepted
        while len(self.served_by) > _SERVED_BY_KEPT:
            self.served_by.popitem(last=False)
        sink: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self._pump(stream, ids, sink, accepted))
        for rid in ids:
            self._pumps[rid] = (task, sink)
        return ids, sink

    async def _pump(self, stream: Any, ids: list[str], sink: asyncio.Queue, accepted: Accepted) -> None:
        pending = set(ids)
        try:
            async for item in stream:
                if isinstance(item, Done):
                    pending.discard(item.request_id)
                sink.put_nowait(item)
        except asyncio.CancelledError:
            stream.cancel()  # the replica's generator aborts what it still runs
            raise
        except Exception as err:
            logger.warning("replica %s (pid %d) failed mid-request: %s", accepted.replica, accepted.pid, err)
            for rid in sorted(pending):
                sink.put_nowait(RuntimeError(f"the replica serving this request failed ({type(err).__name__}); "
                                             "retry the request"))
                sink.put_nowait(Done(rid))
        finally:
            for rid in ids:
                self._pumps.pop(rid, None)

    def abort(self, request_ids: list[str]) -> None:
        """For a client gone mid-request: its replica aborts it."""
        for rid in request_ids:
            if rid in self._pumps:
                self._pumps[rid][0].cancel()

    def abort_all(self, message: str) -> None:
        """Ends every request with an error its handler reports; for a shutdown that cannot wait."""
        from kvserve.server.async_engine import Draining
        for rid, (task, sink) in list(self._pumps.items()):
            task.cancel()
            sink.put_nowait(Draining(message))
            sink.put_nowait(Done(rid))

    def wait_idle(self, timeout: float) -> bool:
        """Blocks (off the event loop) until no request is in flight or `timeout` passes."""
        import time
        deadline = time.monotonic() + timeout
        while self._pumps and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._pumps

    def replica_ids(self) -> list[str]:
        import ray
        prefix = f"SERVE_REPLICA::{APP_NAME}#EngineReplica#"
        return sorted(a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(prefix))

    async def each_replica(self, method: str, *args: Any) -> dict[str, Any]:
        """`method` on every live replica (by id); a replica that does not answer in time is left out."""
        async def one(rid: str) -> Any:
            return await asyncio.wait_for(getattr(self.handle, method).remote(*args, pin=rid), _CALL_TIMEOUT_S)
        ids = self.replica_ids()
        results = await asyncio.gather(*(one(rid) for rid in ids), return_exceptions=True)
        return {rid: r for rid, r in zip(ids, results) if not isinstance(r, BaseException)}

    async def metrics_text(self) -> bytes:
        return merge_metrics({rid: text.decode() for rid, text in (await self.each_replica("metrics_text")).items()})

    async def kv_state(self, expose_request_ids: bool, replica: str | None = None) -> dict[str, Any]:
        ids = self.replica_ids()
        if not ids:
            raise RuntimeError("no replica is running")
        if replica is not None and replica not in ids:  # a restarted replica has a new id
            raise FieldError("replica", f"replica: no replica {replica!r} runs here; these do: {', '.join(ids)}")
        chosen = replica or ids[0]
        state = await asyncio.wait_for(self.handle.kv_state.remote(expose_request_ids, pin=chosen), _CALL_TIMEOUT_S)
        return {**state, "replica": chosen, "replicas": ids}


def _start_ray(host: str) -> None:
    """Starts a local Ray cluster, unless one runs in this process or RAY_ADDRESS names one (whose
    operator then decides what it exposes: README, replicas). Ray runs whatever code reaches its
    ports, so a server bound to loopback keeps its Ray on loopback too: Ray's gRPC servers and
    agents listen on loopback alone when the node's address is loopback, on every interface
    otherwise. On Linux Ray replaces a loopback node address by the machine's outward one (its
    nodes may span hosts) unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, its one-machine switch,
    which it reads once, when imported."""
    local, loopback = "RAY_ADDRESS" not in os.environ, is_loopback(host)
    if local and loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home from a server
    if not local:
        ray.init(log_to_driver=False)
        return
    node = ray.util.get_node_ip_address() if loopback else _address_or_none(host)
    if loopback and not is_loopback(node):  # type: ignore[arg-type]
        raise RuntimeError(f"Ray was imported before kvserve could keep it on loopback (its node address would "
                           f"be {node}): set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray")
    ray.init(_node_ip_address=node, include_dashboard=False, log_to_driver=False)


def _address_or_none(host: str) -> str | None:
    """`host` as Ray's node address: a specific IP address, or None (Ray picks) for a wildcard
    or a name."""
    try:
        return None if ipaddress.ip_address(host).is_unspecified else host
    except ValueError:
        return None


def _unwrap(err: Exception) -> Exception:
    """Ray wraps a replica's exception; the app answers by its kind (400, 429, 503)."""
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, Exception) else err
