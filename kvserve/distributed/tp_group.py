"""The ranks of one tensor-parallel engine: rank 0 is the engine's own process (it schedules),
ranks 1.. are worker processes kvserve spawns. Each step rank 0 broadcasts what the runner will
execute (`StepInput`: the step's block operations, tokens and metadata, as vLLM's executor sends
its SchedulerOutput) and every rank runs it; the o_proj and down_proj all-reduces keep them in
step. gloo, on the CPU (NCCL for CUDA is not built: EngineConfig refuses it).

A rank that dies is seen by rank 0 before its next step (its process has ended) or by the
closed connection of the collective it was in: the engine's step raises, the server fails its
requests and exits non-zero. A rank whose peer ends (rank 0 gone) stops.
"""
from __future__ import annotations

import datetime
import multiprocessing
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvserve.config import EngineConfig
from kvserve.net import free_loopback_port

_IDLE_TIMEOUT = datetime.timedelta(days=7)


def init_group(rank: int, world: int, port: int, startup_timeout_s: float) -> dist.ProcessGroup:
    """A gloo process group of its own (not torch.distributed's default one, which a process has
    only once: a test or a server may hold several engines). Joining waits `startup_timeout_s`
    for every rank; afterwards a rank waits for the next step as long as the engine idles (a week
    per operation): a dead peer is noticed by its closed connection, not by a timeout."""
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=startup_timeout_s))
    return dist.ProcessGroupGloo(store, rank, world, _IDLE_TIMEOUT)


def broadcast_object(group: dist.ProcessGroup, obj: Any, rank: int) -> Any:
    """Rank 0's `obj` on every rank, pickled into a byte tensor (size first, then the bytes)."""
    if rank == 0:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
    else:
        size = torch.zeros(1, dtype=torch.long)
    group.broadcast(size, 0).wait()
    if rank != 0:
        data = torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(data, 0).wait()
    return obj if rank == 0 else pickle.loads(data.numpy().tobytes())


class TPGroup:
    def __init__(self, group: dist.ProcessGroup, workers: list[multiprocessing.Process]) -> None:
        self.group, self.workers = group, workers

    @classmethod
    def start(cls, config: EngineConfig, num_blocks: int, worker_main: Callable[..., None],
              timeout_s: float = 600.0) -> "TPGroup":
        """Spawns ranks 1.. running `worker_main(config, rank, port, num_blocks, timeout_s)` (the
        engine's, engine/tp_worker.py) and joins the group as rank 0."""
        world = config.parallel.tensor_parallel_size
        port = free_loopback_port()
        ctx = multiprocessing.get_context("spawn")  # a fork would copy rank 0's threads and model
        workers = [ctx.Process(target=worker_main, args=(config, rank, port, num_blocks, timeout_s), daemon=True,
                               name=f"kvserve-tp-rank-{rank}") for rank in range(1, world)]
        for w in workers:
            w.start()
        return cls(init_group(0, world, port, timeout_s), workers)

    def dead_workers(self, grace_s: float = 0.0) -> list[str]:
        """Names of the ranks whose process has ended; `grace_s`: how long to let a rank that is
        dying finish (a collective can fail on a closed socket before its peer is reaped)."""
        for w in self.workers:
            w.join(grace_s)
        return [w.name for w in self.workers if not w.is_alive()]

    def broadcast(self, step: Any) -> None:
        """Sends one step (or None: stop) to every worker."""
        dead = self.dead_workers()
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) {', '.join(dead)} died")
        broadcast_object(self.group, step, 0)

    def close(self) -> None:
        if not self.dead_workers():
            self.broadcast(None)
        for w in self.workers:
            w.join(10)
            if w.is_alive():
                w.kill()
