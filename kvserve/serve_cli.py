"""`kvserve serve`: the OpenAI-compatible HTTP server, one engine or replicas behind a router.

It sits above both `server` and `replicas` (it builds either front), which is why it is inside
neither. On SIGTERM it stops admitting (503), lets running requests finish (`--shutdown-timeout`,
then ends the rest with an error) and exits 0; an engine that can run no further step (a dead
tensor-parallel rank) makes it exit 1.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from typing import Any

from kvserve.arg_types import at_least, non_empty, number
from kvserve.engine_args import add_engine_args, engine_kwargs, llm_from_args
from kvserve.replicas.settings import ROUTERS


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serves /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                   "/metrics (Prometheus) and a live KV-cache dashboard at /.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=at_least(0, 65535), default=8000, help="port (default 8000)")
    p.add_argument("--max-waiting", type=at_least(0), default=512,
                   help="requests that may wait for a batch slot, beyond those the batch's free slots take at "
                        "once; past it the server answers 429 (default 512; 0: 429 once the batch is full)")
    p.add_argument("--retry-after", type=at_least(0), default=1,
                   help="seconds a 429 tells the client to wait (Retry-After header; default 1)")
    p.add_argument("--shutdown-timeout", type=number(at_least=0), default=30.0,
                   help="on SIGTERM, seconds to let running requests finish before aborting them "
                        "(default 30)")
    p.add_argument("--served-model-name", type=non_empty, default=None,
                   help="the model id clients see in /v1/models and responses (default: from the file)")
    p.add_argument("--api-key", type=non_empty, default=os.environ.get("KVSERVE_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (the API, /metrics, "
                        "/kv/state and the dashboard: open it as /#key=KEY); default $KVSERVE_API_KEY, else open")
    p.add_argument("--expose-request-ids", action="store_true",
                   help="list request ids in /kv/state and the dashboard (default: numbered, not named)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names to answer ('*': any); default: the loopback names "
                        "when bound to loopback, the bound address otherwise, any for 0.0.0.0")
    p.add_argument("--max-request-bytes", type=at_least(1024), default=4 * 2**20,
                   help="largest request body accepted; larger ones get 413 (default 4 MiB)")
    p.add_argument("--start-redis", action="store_true",
                   help="start a redis-server of this server's own (loopback, nothing on disk) and use it as "
                        "--kv-remote: a quick try of the shared KV tier on one machine")
    p.add_argument("--replicas", type=at_least(1), default=1,
                   help="engines to run, as one Ray Serve deployment behind a router (ray[serve]: pip install "
                        "'kvserve[ray]'); a local Ray cluster starts unless RAY_ADDRESS names one; 1: one engine "
                        "in this process (default)")
    p.add_argument("--router", default="prefix", choices=ROUTERS,
                   help="with --replicas: prefix sends a request to the replica holding the longest run of its "
                        "prompt's blocks (as each replica's periodic report says), balanced against queue length; "
                        "prefix-events the same, following each replica's KV events, so a block it evicted stops "
                        "attracting requests at once; power-of-two is Ray Serve's default; round-robin reads no "
                        "state (default: prefix)")
    p.add_argument("--router-stats-period", type=number(above=0), default=1.0,
                   help="with --replicas: seconds between each replica's report of its cached blocks and queue "
                        "to the router (default 1)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="level of kvserve's and uvicorn's logs (default info)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from kvserve.server.app import build_app
    from kvserve.server.async_engine import AsyncEngine
    from kvserve.server.metrics import Metrics
    from kvserve.server.settings import ServerSettings
    from kvserve.server.startup_heap import freeze_startup_heap

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.start_redis:
        if args.kv_remote is not None:
            raise SystemExit("kvserve serve: --start-redis and --kv-remote both name the KV tier; pass one")
        from kvserve.server.local_redis import start_local_redis
        args.kv_remote = start_local_redis()
        print(f"kvserve: KV tier in a local redis-server at {args.kv_remote}", flush=True)
    if args.replicas > 1:
        from kvserve.config import EngineConfig
        from kvserve.replicas.front import ReplicaFront
        from kvserve.replicas.settings import ReplicaSettings

        replica_settings = ReplicaSettings(args.replicas, args.router, args.router_stats_period, host=args.host)
        aengine: Any = ReplicaFront.start(EngineConfig.of(**engine_kwargs(args)), replica_settings, args.max_waiting)
        on_start, on_stop = (lambda: None), ReplicaFront.stop
        serving = f"{aengine.model_name} ({args.replicas} replicas, {args.router} routing)"
    else:
        llm = llm_from_args(args)
        # An engine that can run no further step (a tensor-parallel rank died) has already failed
        # every request: stop serving (`server` is bound below, before anything can fail) and
        # exit non-zero after uvicorn's shutdown.
        aengine = AsyncEngine(llm.engine, Metrics(), args.max_waiting,
                              on_fatal=lambda: setattr(server, "should_exit", True))
        on_start, on_stop = aengine.start, (lambda: (aengine.shutdown(timeout=0), llm.engine.close()))
        serving = llm.engine.model_name
    settings = ServerSettings(args.retry_after, args.served_model_name, args.api_key, args.expose_request_ids,
                              ServerSettings.hosts_for(args.host, args.allowed_hosts), args.max_request_bytes)
    app = build_app(aengine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        on_start()
        freeze_startup_heap()
        print(f"kvserve: serving {serving} on http://{args.host}:{args.port}", flush=True)
        yield
        # uvicorn has already waited for open requests (up to the timeout); abort what is left.
        on_stop()

    app.router.lifespan_context = lifespan

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if aengine.draining:  # a second signal: stop now
                super().handle_exit(sig, frame)
                return
            # Keep listening while running requests finish, so that new ones get 503 rather than
            # a refused connection; then end what is left with an error event, then exit.
            aengine.begin_drain()
            threading.Thread(target=self.drain, args=(sig,), daemon=True).start()

        def drain(self, sig: int) -> None:
            if not aengine.wait_idle(args.shutdown_timeout):
                aengine.abort_all(f"the server shut down before this request finished "
                                  f"(--shutdown-timeout {args.shutdown_timeout:g} s)")
                aengine.wait_idle(5.0)
            super().handle_exit(sig, None)

    # The drain above already waited for requests; uvicorn's own wait only lets handlers write.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    # uvicorn re-raises the signal after its graceful shutdown, under the handler found at start:
    # with this one, a drained server exits with status 0 instead of dying by SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = Server(config)
    server.run()
    if getattr(aengine, "fatal", None):
        print(f"kvserve: stopped: {aengine.fatal}", file=sys.stderr, flush=True)
        sys.exit(1)
