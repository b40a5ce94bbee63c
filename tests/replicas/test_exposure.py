"""What a `--replicas` server exposes: a loopback server keeps the Ray cluster it starts on loopback
(issue 39: Ray's servers listened on every interface, and Ray runs whatever code reaches them)."""
from __future__ import annotations

import importlib.util
import ipaddress

import httpx
import psutil
import pytest

from kvserve.bench.serve_load import ServerProcess

if importlib.util.find_spec("ray") is None:
    pytest.skip("ray[serve] is not installed (pip install 'kvserve[ray]')", allow_module_level=True)


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


def test_a_loopback_server_keeps_its_ray_cluster_on_loopback() -> None:
    srv = ServerProcess("--replicas", "2", "--host", "127.0.0.1", "--api-key", "K", "--model", "random:tiny",
                        "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-model-len", "256",
                        start_timeout=240)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                       headers={"authorization": "Bearer K"}, timeout=60)
        assert r.status_code == 200, r.text
        commands, sockets = open_sockets(psutil.Process(srv.proc.pid))
        # The processes that listened on every interface are all there, so none was missed.
        for part in ("gcs_server", "raylet", "ServeController", "ServeReplica", "DashboardAgent"):
            assert any(part in c for c in commands), (part, commands)
        assert len(sockets) > 10
        assert [s for s in sockets if not is_loopback(s[1])] == []
    finally:
        srv.stop()
