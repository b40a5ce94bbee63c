"""`kvserve serve --start-redis`: a redis-server of the server's own, for trying the shared KV
tier on one machine. It binds loopback only, keeps nothing on disk, and dies with the server."""
from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import time

from kvserve.net import free_loopback_port


def start_local_redis() -> str:
    """Starts redis-server on a free loopback port; returns its URL. Raises SystemExit with the
    way to install it when it is not on PATH."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("kvserve serve --start-redis: redis-server is not on PATH "
                         "(Debian: apt-get install redis-server), or pass --kv-remote redis://HOST:PORT")
    port = free_loopback_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(proc.kill)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvserve serve --start-redis: redis-server exited with status {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("kvserve serve --start-redis: redis-server did not start within 10 s")
