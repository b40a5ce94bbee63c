"""`kvserve serve` in another process, for load benchmarks (bench/serving.py) and tests."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from kvserve.net import free_loopback_port


class ServerProcess:
    """`kvserve serve` on a free loopback port; ready once /health answers."""

    def __init__(self, *args: str, start_timeout: float = 180) -> None:
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvserve", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up in {start_timeout:.0f} s")

    def kv_state(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/kv/state", timeout=30).json()

    def stop(self) -> None:
        """SIGTERM: the server finishes what runs, then exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
