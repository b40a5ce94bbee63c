"""Real `kvserve serve` processes on free loopback ports."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest


class ServerProcess:
    def __init__(self, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not come up in 180 s")

    def kv_state(self) -> dict:
        return httpx.get(f"{self.url}/kv/state", timeout=30).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The bundled model in fp32, so that its output can equal the `smol` fixture's exactly."""
    srv = ServerProcess("--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048")
    yield srv
    srv.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., ServerProcess]]:
    made: list[ServerProcess] = []

    def make(*args: str) -> ServerProcess:
        made.append(ServerProcess(*args))
        return made[-1]

    yield make
    for srv in made:
        srv.stop()
