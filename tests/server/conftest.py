"""Real `kvserve serve` processes on free loopback ports."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvserve.bench.serve_load import ServerProcess


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
