"""A server in a child process on a free loopback port, ready once its health endpoint answers:
`kvserve serve` and the peers of `kvserve bench serve` (llama-server, `transformers serve`) alike.

Its output goes to a file, not a pipe: nobody reads a pipe while the benchmark runs, and a server
that logs every request (llama-server does) would block on a full one. The file's tail is what a
start that fails reports.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable

import httpx

from kvserve.net import free_loopback_port

LOG_TAIL_CHARS = 2000


class ChildServer:
    """`command(port)` started on a free port; `url` answers once `health` returns 200."""

    def __init__(self, command: Callable[[int], list[str]], name: str, start_timeout: float = 180,
                 env: dict[str, str] | None = None, health: str = "/health") -> None:
        self.name = name
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+t")
        self.proc = subprocess.Popen(command(self.port), stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env=None if env is None else {**os.environ, **env})
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                output = self.output()
                self.log.close()
                raise RuntimeError(f"{name} exited with code {self.proc.returncode} before it was ready: {output}")
            try:
                if httpx.get(f"{self.url}{health}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        output = self.output()
        self.stop()
        raise RuntimeError(f"{name} did not come up in {start_timeout:.0f} s: {output}")

    def output(self) -> str:
        """The last lines the server wrote."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-LOG_TAIL_CHARS:]

    def stop(self) -> None:
        """SIGTERM: the server finishes what runs, then exits; killed after a minute."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
