"""A free TCP port on the loopback interface, for the servers and process groups kvserve starts."""
from __future__ import annotations

import socket


def free_loopback_port() -> int:
    """A port nothing listens on now (the OS picks it); the caller binds it soon after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
