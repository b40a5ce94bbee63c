"""HF transformers timed in a process of its own, with OpenMP's default spin.

`import kvserve` sets `GOMP_SPINCOUNT=1000` (kvserve/threads.py: on a shared machine torch's idle
OpenMP workers otherwise spin through kvserve's own kernels). A peer timed in the same process
would inherit it, and transformers' many short OpenMP regions then wake sleeping workers every
op: HF measured ~2x slower than in a process of its own (BENCHMARKS.md, issue 38). The child gets
libgomp's own default (300,000 spins), what HF runs with anywhere else, and keeps the model loaded
so that rounds can still take turns with kvserve.
"""
from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection

import torch

# libgomp's default spin count when OMP_WAIT_POLICY is unset.
OPENMP_DEFAULT_SPINCOUNT = "300000"


def _serve(conn: Connection, source: str, dtype: torch.dtype, threads: int) -> None:
    from kvserve.bench.hf_baseline import hf_step_times, load_hf_bench_model

    torch.set_num_threads(threads)
    model, _ = load_hf_bench_model(source, dtype)
    conn.send("ready")
    while (request := conn.recv()) is not None:
        if request == "environment":  # what the child runs with, for the tests
            conn.send(dict(os.environ))
            continue
        prompt, num_tokens = request
        conn.send(hf_step_times(model, prompt, num_tokens, 0))


class HFProcess:
    """`step_times(prompt, n)`: seconds each of n tokens took, as `hf_step_times` in the child."""

    def __init__(self, source: str, dtype: torch.dtype, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        saved = os.environ.get("GOMP_SPINCOUNT")
        os.environ["GOMP_SPINCOUNT"] = OPENMP_DEFAULT_SPINCOUNT  # the child's environment, at spawn
        try:
            self._process = context.Process(target=_serve, args=(child, source, dtype, threads), daemon=True)
            self._process.start()
        finally:
            if saved is None:
                del os.environ["GOMP_SPINCOUNT"]
            else:
                os.environ["GOMP_SPINCOUNT"] = saved
        child.close()
        if self._recv() != "ready":
            raise RuntimeError("HF peer process: unexpected reply while loading")

    def _recv(self) -> object:
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"HF peer process died (exit code {self._process.exitcode})") from None

    def step_times(self, prompt: list[int], num_tokens: int) -> list[float]:
        self._conn.send((prompt, num_tokens))
        times = self._recv()
        assert isinstance(times, list)
        return times

    def environment(self) -> dict[str, str]:
        self._conn.send("environment")
        env = self._recv()
        assert isinstance(env, dict)
        return env

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=10)
        self._conn.close()
