"""Two tiny-model replicas on a local Ray cluster, behind the prefix-aware router and the HTTP app;
what that cluster exposes."""
from __future__ import annotations

import asyncio
import importlib.util
import ipaddress
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

# Not imported here: kvserve sets what Ray reads when imported (replicas.front._start_ray).
if importlib.util.find_spec("ray") is None:
    pytest.skip("ray[serve] is not installed (pip install 'kvserve[ray]')", allow_module_level=True)

from kvserve import SamplingParams  # noqa: E402
from kvserve.config import EngineConfig  # noqa: E402
from kvserve.replicas.front import ReplicaFront  # noqa: E402
from kvserve.replicas.settings import ReplicaSettings  # noqa: E402
from kvserve.server.async_engine import Done  # noqa: E402
from kvserve.net import free_loopback_port  # noqa: E402
from tests.conftest import TINY  # noqa: E402

SHARED = [(11 * j + 5) % 128 for j in range(64)]  # four full blocks


class Served:
    """The front and the app on a uvicorn thread, with one event loop for direct calls."""

    def __init__(self) -> None:
        import uvicorn

        from kvserve.server.app import build_app

        config = EngineConfig.of(model=TINY, dtype="float32", device="cpu", kv_cache_memory="4MiB", max_model_len=512)
        self.front = ReplicaFront.start(config, ReplicaSettings(2, "prefix", stats_period_s=0.2), max_waiting=64)
        self.port = free_loopback_port()
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.front), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def run(self, coro: Any) -> Any:
        """Runs a coroutine on a loop of the test's own (the app's requests run on uvicorn's)."""
        if not hasattr(self, "loop"):
            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def generate(self, prompt: list[int], max_tokens: int = 4) -> tuple[str, list[int]]:
        """(the replica that served it, its tokens)."""
        async def go() -> tuple[str, list[int]]:
            ids, sink = await self.front.submit([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                         ignore_eos=True), f"t-{time.monotonic_ns()}")
            tokens: list[int] = []
            while True:
                item = await sink.get()
                if isinstance(item, Done):
                    return self.front.served_by[ids[0]].replica, tokens
                if isinstance(item, Exception):
                    raise item
                tokens = item.token_ids
        return self.run(go())

    def counters(self) -> dict[str, dict[str, Any]]:
        return self.run(self.front.each_replica("counters"))

    def stop(self) -> None:
        import ray

        self.server.should_exit = True
        self.thread.join(10)
        ReplicaFront.stop()
        ray.shutdown()  # the local cluster's daemons would otherwise idle beside the later tests


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.stop()


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


def open_sockets(root: psutil.Process) -> tuple[list[str], list[tuple[str, str]]]:
    """The command lines of `root` and every process under it, and (command, address) of each
    socket they accept on: TCP listening, UDP unconnected."""
    commands, sockets = [], []
    for proc in [root, *root.children(recursive=True)]:
        try:
            command = " ".join(proc.cmdline())
            connections = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        commands.append(command)
        sockets += [(command[:60], c.laddr.ip) for c in connections
                    if c.status == psutil.CONN_LISTEN or (c.status == psutil.CONN_NONE and not c.raddr)]
    return commands, sockets


def test_a_loopback_front_keeps_its_ray_cluster_on_loopback(served: Served) -> None:
    """Issue 39: Ray's servers listened on every interface, and Ray runs whatever code reaches
    them. The front binds 127.0.0.1 (ReplicaSettings.host, what `kvserve serve --replicas N
    --host` sets), so every socket that this process and the cluster it started accept on is
    loopback (the same cluster as the tests beside: a second one cost over a minute of the suite)."""
    commands, sockets = open_sockets(psutil.Process())
    # The processes that listened on every interface are all there, so none was missed.
    for part in ("gcs_server", "raylet", "ServeController", "ServeReplica", "DashboardAgent"):
        assert any(part in c for c in commands), (part, commands)
    assert len(sockets) > 10
    assert [s for s in sockets if not is_loopback(s[1])] == []


def test_a_cached_prefix_draws_its_requests_to_the_replica_holding_it(served: Served) -> None:
    owner, _ = served.generate(SHARED + [1, 2, 3])
    time.sleep(0.6)  # a few routing-stats periods: the router now knows from the replicas themselves
    before = served.counters()
    for i in range(4):
        replica, _ = served.generate(SHARED + [7, i, 9])
        assert replica == owner
    after = served.counters()
    assert after[owner]["cached_tokens"] - before[owner]["cached_tokens"] == 4 * 64
    other = next(r for r in after if r != owner)
    assert after[other]["cached_tokens"] == before[other]["cached_tokens"]


def test_requests_without_a_cached_prefix_spread_over_both(served: Served) -> None:
    seen = {served.generate([(j * (i + 3) + i) % 128 for j in range(20)])[0] for i in range(12)}
    assert len(seen) == 2


def test_the_openai_client_works_unchanged(served: Served) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused")
    done = client.completions.create(model=served.front.model_name, prompt=SHARED[:20], max_tokens=5, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    chunks = list(client.completions.create(model=served.front.model_name, prompt=SHARED[:20], max_tokens=5,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    import httpx
    metrics = httpx.get(f"http://127.0.0.1:{served.port}/metrics").text
    assert metrics.count('kvserve_prompt_tokens_total{replica="') == 2  # both replicas, one page
    state = httpx.get(f"http://127.0.0.1:{served.port}/kv/state").json()
    assert len(state["replicas"]) == 2 and state["replica"] == state["replicas"][0]
    second = httpx.get(f"http://127.0.0.1:{served.port}/kv/state", params={"replica": state["replicas"][1]}).json()
    assert second["replica"] == state["replicas"][1] and len(second["states"]) == second["num_blocks"]
    unknown = httpx.get(f"http://127.0.0.1:{served.port}/kv/state", params={"replica": "zzz"})  # was the first's
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "replica", unknown.text


def test_abort_stops_the_replica_generating_for_a_client_that_left(served: Served) -> None:
    """A client gone after its first tokens: the front cancels the stream and the replica aborts
    the request, so it computes a few of its 500 tokens, not all of them."""
    prompt = SHARED[:10]

    async def first_tokens_then_abort() -> str:
        ids, sink = await served.front.submit([prompt], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
                                              f"gone-{time.monotonic_ns()}")
        await sink.get()
        served.front.abort(ids)
        return served.front.served_by[ids[0]].replica

    def computed(replica: str) -> int:
        return served.counters()[replica]["tokens_computed"]

    before = {tag: c["tokens_computed"] for tag, c in served.counters().items()}
    replica = served.run(first_tokens_then_abort())
    settled, previous = computed(replica), -1
    while settled != previous:  # until the replica stops computing
        time.sleep(0.5)
        previous, settled = settled, computed(replica)
    assert settled - before[replica] < len(prompt) + 250
    assert not served.front._pumps


def test_a_replica_killed_mid_stream_ends_that_stream_with_an_error_and_the_next_request_succeeds(
        served: Served) -> None:
    import json

    import httpx
    body = {"prompt": SHARED[:10], "max_tokens": 400, "ignore_eos": True, "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True}}
    before = set(served.front.served_by)
    with httpx.stream("POST", f"http://127.0.0.1:{served.port}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data:"))]
        # A few tokens into its 400, kill the replica that took the request.
        (request_id,) = set(served.front.served_by) - before
        os.kill(served.front.served_by[request_id].pid, signal.SIGKILL)
        events += [line for line in lines if line.startswith("data:")]
    assert len(events) >= 3 and '"error"' in events[-3] and events[-1] == "data: [DONE]", events
    assert json.loads(events[-3][5:])["error"]["message"].startswith("the replica serving this request failed")
    # The usage counts the tokens streamed before the failure (it counted finished choices only: 0).
    sent = sum(len(json.loads(e[5:])["choices"][0]["logprobs"]["tokens"]) for e in events[:-3])
    assert sent > 0 and json.loads(events[-2][5:])["usage"]["completion_tokens"] == sent
    for _ in range(3):  # Serve restarts the replica; the router sends elsewhere meanwhile
        reply = httpx.post(f"http://127.0.0.1:{served.port}/v1/completions",
                           json={"prompt": SHARED[:12], "max_tokens": 3}, timeout=60)
        assert reply.status_code == 200, reply.text
